"""The drafter protocol: what the one decode loop (`specdec.decode`) asks of every drafter.

A decoding step, for a batch of rows:

1. `propose(seqs, k, rows)` returns a `DraftTree` per row: N draft tokens, each with a parent
   (-1 = the root, which is the token the target chose last and has not scored yet) and, when
   the draft was sampled, the distribution it was drawn from. A chain of k drafts is a tree with
   one branch (parents -1, 0, 1, ...); a Medusa or EAGLE tree has several children per node;
   plain decoding proposes nothing (N = 0).
2. The loop scores [root, nodes] in one target forward (causal for a chain, the tree's ancestor
   mask otherwise), verifies every row (`specdec.verify`) and emits the accepted path plus one
   token from the target.
3. `commit(accepted)` tells the drafter the accepted path of every row and the new committed
   sequences, so it can roll its own state back (a draft model's cache) or advance it (the
   hidden state Medusa heads read next).

The serving engine (`specdec.serving.engine`) reuses the rows of one batch for request after request:
it calls `reserve(batch_size, max_len)` once instead of `begin`, then `admit(row, prompt, hidden)`
when a request takes a free row and `release(row)` when it leaves; the other rows keep drafting.
A drafter that cannot do this raises NotImplementedError (the defaults), naming itself.

A new drafter is one file: a subclass of `Drafter` that implements `propose` (and `begin` /
`commit` when it keeps state). `specdec.loader.make_drafter` turns generate()'s `draft=`
argument into a drafter; an instance of a `Drafter` subclass passes through unchanged.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch


@dataclass
class DraftTree:
    """Draft tokens of a batch, as one tree per row.

    tokens (B, N): draft token ids (anything past a row's `lens` is padding).
    parents (B, N): the parent of each node, -1 for the root; a parent precedes its children
        (parents[b, i] < i) and siblings are listed best first.
    lens (B,): valid nodes per row, nodes [0, lens[b]).
    q (B, N, V) or None: the distribution each node was drawn from when the draft was sampled
        (siblings drawn independently from their parent's distribution); None when the draft is
        deterministic (argmax, top-k, n-gram lookup), i.e. q is one-hot.
    scores (B, N) or None: the drafter's own estimate that each node's whole path is accepted (a
        suffix match's frequencies, a draft model's probabilities); their sum over a row is the
        accepted length it expects. None when the drafter makes no estimate.
    sized_by_k (B,) bool or None: the rows whose drafts follow the step's k, which the loop's `auto`
        draft length learns from (a composite drafter's rows that took a fixed-size member's tree
        are not); None = every row.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    lens: torch.Tensor
    q: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    sized_by_k: torch.Tensor | None = None
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.tokens.shape != self.parents.shape or self.tokens.dim() != 2:
            raise ValueError(f"a DraftTree needs tokens and parents of one shape (B, N), got "
                             f"{tuple(self.tokens.shape)} and {tuple(self.parents.shape)}")
        if self.lens.shape != self.tokens.shape[:1]:
            raise ValueError(f"DraftTree.lens must be (B,) = ({self.tokens.shape[0]},), got {tuple(self.lens.shape)}")
        if self.q is not None and self.q.shape[:2] != self.tokens.shape:
            raise ValueError(f"DraftTree.q must be (B, N, V) with (B, N) = {tuple(self.tokens.shape)}, "
                             f"got {tuple(self.q.shape)}")
        if self.scores is not None and self.scores.shape != self.tokens.shape:
            raise ValueError(f"DraftTree.scores must be (B, N) = {tuple(self.tokens.shape)}, got "
                             f"{tuple(self.scores.shape)}")
        n = self.tokens.shape[1]
        if n and bool(((self.parents < -1) | (self.parents >= torch.arange(n, device=self.parents.device))).any()):
            raise ValueError("DraftTree.parents must satisfy -1 <= parents[b, i] < i (a parent precedes "
                             "its children)")

    @classmethod
    def chain(cls, tokens: torch.Tensor, lens: torch.Tensor, q: torch.Tensor | None = None,
              scores: torch.Tensor | None = None) -> "DraftTree":
        """A chain of drafts per row: tokens (B, k), lens (B,), q (B, k, V) or None, scores (B, k) or None."""
        B, k = tokens.shape
        parents = (torch.arange(k) - 1)[None].expand(B, k).contiguous()
        tree = cls(tokens, parents, lens, q, scores)
        tree._cache["chain"] = True
        return tree

    @classmethod
    def empty(cls, batch_size: int) -> "DraftTree":
        """No drafts (plain decoding)."""
        return cls.chain(torch.zeros(batch_size, 0, dtype=torch.long), torch.zeros(batch_size, dtype=torch.long))

    def truncate(self, n: int) -> "DraftTree":
        """The first n nodes (valid nodes are a prefix, and parents precede children)."""
        tree = DraftTree(self.tokens[:, :n], self.parents[:, :n], self.lens.clamp(max=n),
                         None if self.q is None else self.q[:, :n], None if self.scores is None else self.scores[:, :n],
                         self.sized_by_k)
        if self._cache.get("chain"):
            tree._cache["chain"] = True
        return tree

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    @property
    def is_chain(self) -> bool:
        """Whether every node's parent is the node before it (one branch, causal attention)."""
        if "chain" not in self._cache:
            n = self.num_nodes
            self._cache["chain"] = bool((self.parents == torch.arange(n) - 1).all())
        return self._cache["chain"]

    def depths(self) -> torch.Tensor:
        """(B, N) depth of every node: 1 for a child of the root."""
        if "depths" not in self._cache:
            B, n = self.tokens.shape
            depth = torch.zeros(B, n, dtype=torch.long)
            for i in range(n):  # parents precede children: one pass in order
                p = self.parents[:, i]
                depth[:, i] = 1 + torch.where(p >= 0, depth.gather(1, p.clamp(min=0)[:, None])[:, 0], 0)
            self._cache["depths"] = depth
        return self._cache["depths"]

    def block_mask(self) -> torch.Tensor:
        """(B, 1 + N, 1 + N) bool over [root, nodes]: [b, i, j] when j is i or an ancestor of i."""
        if "block_mask" not in self._cache:
            B, n = self.tokens.shape
            anc = torch.zeros(B, n + 1, n + 1, dtype=torch.bool)
            anc[:, 0, 0] = True
            rows = torch.arange(B)
            for i in range(n):  # a node sees what its parent sees, and itself
                anc[:, i + 1] = anc[rows, self.parents[:, i] + 1]
                anc[:, i + 1, i + 1] = True
            self._cache["block_mask"] = anc
        return self._cache["block_mask"]

    def path(self, row: int, node: int) -> list[int]:
        """Nodes from the root's child down to `node` (-1: the root, an empty path)."""
        out = []
        parents = self.parents[row].tolist()
        while node >= 0:
            out.append(node)
            node = parents[node]
        return out[::-1]


@dataclass
class Accepted:
    """What one verification step kept, for `Drafter.commit`.

    seqs: every row's committed sequence (prompt + emitted tokens; the last one is the next
        root, not yet scored by the target).
    paths: per row, the accepted draft nodes (indices into the step's DraftTree), from the
        root's child down (the root itself is not a node).
    hidden (B, 1 + N, C) or None: the target's final hidden states over [root, nodes] of the
        step, when the drafter asked for them (`Drafter.needs_hidden`); the state that chose the
        next root is hidden[b, 1 + paths[b][-1]] (hidden[b, 0] when the path is empty). For a
        drafter with `hidden_layers`, the states entering those target layers instead
        (B, 1 + N, len(hidden_layers) * C), from the same verification forward.
    block: the rows that verification scored per row (1 + N; 0 when not told).
    target_s: the seconds the target's forward and the verification took (0.0 when not told): what
        a drafter that sizes its proposals by cost learns from (`specdec.tuning.costs.BlockCosts`).
    verified: per row, whether this drafter's proposal is the one that was verified (a composite
        verifies one member's per row and tells each member so); None: every row's was.
    step: the verification's number in this process (0 when not told): a cost store that several
        observers share (`specdec.tuning.costs.target_costs`) records each verification once.
    """

    seqs: list[torch.Tensor]
    paths: list[list[int]]
    hidden: torch.Tensor | None = None
    block: int = 0
    target_s: float = 0.0
    verified: list[bool] | None = None
    step: int = 0

    def last_hidden(self) -> torch.Tensor:
        """(B, C): per row, the hidden state that chose the next root."""
        if self.hidden is None:
            raise ValueError("no hidden states: the drafter did not set needs_hidden")
        idx = torch.tensor([1 + p[-1] if p else 0 for p in self.paths], device=self.hidden.device)
        return self.hidden[torch.arange(len(self.paths), device=self.hidden.device), idx]


@dataclass(frozen=True)
class TypicalAcceptance:
    """Typical acceptance (lossy; Cai et al. 2024): accept draft x when
    p(x) > min(epsilon, delta * exp(-H(p))). Applies at temperature > 0 only."""

    epsilon: float = 0.09
    delta: float = 0.3

    def __post_init__(self) -> None:
        if not (0 < self.epsilon <= 1 and 0 < self.delta):
            raise ValueError(f"typical acceptance needs 0 < epsilon <= 1 and delta > 0, got "
                             f"epsilon={self.epsilon}, delta={self.delta}")


class Drafter(ABC):
    """Proposes draft tokens for the target to verify; see the module docstring for the step.

    Class attributes a drafter may override:
    name: how reports call it.
    adaptive: True when `propose(k)` drafts (up to) k tokens, so `num_draft_tokens="auto"` may
        tune k per step from `draft_cost`; False for a fixed tree, which ignores k.
    runs_model: True when proposing runs a model (a forward per token, a prompt prefill per row): a
        composite drafter runs it only where it has measured to pay (`specdec.tuning.gates`).
    needs_hidden: True when `begin` and `commit` need the target's final hidden states.
    hidden_layers: target layer ids (vLLM's numbering: layer i's input, 0 = the embedding) whose
        states `begin` and `commit` get instead of the final ones (an EAGLE-3 head's three layers);
        the loop collects them in the target's own forwards (`Transformer.forward(aux_layers=)`), so they
        cost no extra target pass. Empty: none.
    typical: a TypicalAcceptance to verify sampled steps with (lossy), None for lossless
        rejection sampling.
    """

    name: str = "drafter"
    adaptive: bool = True
    runs_model: bool = False
    needs_hidden: bool = False
    hidden_layers: tuple[int, ...] = ()
    typical: TypicalAcceptance | None = None

    def max_nodes(self, k: int) -> int:
        """The most nodes one `propose(..., k, ...)` returns (sizes the KV caches)."""
        return k

    def begin(self, prompts: list[torch.Tensor], max_len: int, hidden: torch.Tensor | None) -> None:
        """Start a generation: the prompts (1-D each), the target's cache length per row, and
        (with needs_hidden) the target's hidden state (B, C) at each prompt's last token, or (with
        hidden_layers) the states of those layers at every prompt position (B, T, len * C), rows
        right-padded to the longest prompt T."""

    def reserve(self, batch_size: int, max_len: int) -> None:
        """Make room for `batch_size` rows, all free, of up to `max_len` target cache slots each
        (the engine's start, instead of `begin`); rows are then filled by `admit`."""
        raise NotImplementedError(f"drafter {self.name!r} ({type(self).__name__}) cannot serve rows that join and "
                                  "leave a running batch: implement reserve / admit / release, or serve with "
                                  "another drafter")

    def admit(self, row: int, prompt: torch.Tensor, hidden: torch.Tensor | None) -> None:
        """Start free row `row` on `prompt` (1-D) while the other rows keep their state; hidden as
        in `begin`, for this row only: (C,) with needs_hidden, (T, len * C) with hidden_layers."""
        raise NotImplementedError(f"drafter {self.name!r} ({type(self).__name__}) cannot admit a row into a "
                                  "running batch: implement reserve / admit / release, or serve with another drafter")

    def cache_prefixes(self, tokens: int) -> None:
        """After `reserve`: the serving engine keeps the target's keys of prompts already read
        (`runtime.prefix_cache`, up to `tokens` positions) and prefills only what a new prompt
        adds. A drafter whose per-row state is a cache of its own (a draft model) may keep one
        too; by default nothing happens and `admit` builds the row from the whole prompt."""

    def release(self, row: int) -> None:
        """Forget row `row`: it is free until the next `admit`."""
        raise NotImplementedError(f"drafter {self.name!r} ({type(self).__name__}) cannot release a row of a "
                                  "running batch: implement reserve / admit / release, or serve with another drafter")

    @abstractmethod
    def propose(self, seqs: list[torch.Tensor], k: int, rows: list[int]) -> DraftTree:
        """Drafts after each row's committed sequence `seqs[b]`, for the rows in `rows` (others
        get lens 0): a DraftTree with B = len(seqs), on the CPU."""

    def commit(self, accepted: Accepted) -> None:
        """The verified step's outcome: roll back or advance the drafter's own state."""

    def draft_cost(self, k: int) -> float:
        """Seconds one `propose` of k tokens is expected to take (for num_draft_tokens="auto")."""
        return 0.0

    def source(self, row: int) -> str:
        """The name of the drafter whose proposal row `row` verified in the last step (a list or a
        composite of drafters: the member's), for acceptance per drafter."""
        return self.name
