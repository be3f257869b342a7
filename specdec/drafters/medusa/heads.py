"""Medusa heads (Cai et al. 2024): K heads on a model's last hidden state, and their candidate tree.

`MedusaHeads` holds K heads on the target's last hidden state (after the final norm). Head i is
`num_layers` zero-initialised residual blocks x + SiLU(W x) followed by an LM head: by default the
base model's own (frozen) `lm_head`, shared by every head, or a separate trainable one per head.
The base LM head at position t predicts token t+1; head i at position t predicts token t+2+i.

`specdec.generate(target, ids, draft=heads)` drafts with them through
`specdec.drafters.medusa.drafter.MedusaDrafter`: the heads' top-k guesses from the hidden state of the
last accepted token, arranged by the heads' sparse tree (`specdec.drafters.medusa.tree`), verified in one target
forward by the decode loop. `attach_medusa` makes new heads for a model and `choose_tree` gives them
the tree an accuracy table favours; saving and loading live in `specdec.drafters.medusa.io`, training in
`distill`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from specdec.drafters.medusa.tree import Path, Tree, build_tree

ACCEPTANCE = ("auto", "lossless", "typical")

# Per-head top-k accuracy measured on held-out self-distilled ShareGPT answers of
# smollm2-135m-instruct, for the heads `python recipes/medusa_smollm2.py --max-minutes 20 --threads 1`
# trained (docs/medusa.md): row i = head i, column r = P(head i's rank-r guess is the true token).
# default_tree() is built from it.
DEFAULT_HEAD_ACCURACY = (
    (0.266, 0.095, 0.054, 0.038, 0.026, 0.024, 0.024, 0.018),
    (0.158, 0.064, 0.043, 0.034, 0.025, 0.022, 0.019, 0.017),
    (0.111, 0.063, 0.041, 0.033, 0.022, 0.017, 0.018, 0.017),
    (0.085, 0.040, 0.032, 0.030, 0.029, 0.023, 0.019, 0.017),
)
DEFAULT_TREE_NODES = 40  # nodes of a Medusa candidate tree unless a spec (medusa:DIR@N) or training says


def default_tree(num_heads: int, num_nodes: int = DEFAULT_TREE_NODES) -> tuple[Path, ...]:
    """The shipped tree for `num_heads` heads (built from DEFAULT_HEAD_ACCURACY)."""
    acc = [list(DEFAULT_HEAD_ACCURACY[min(i, len(DEFAULT_HEAD_ACCURACY) - 1)]) for i in range(num_heads)]
    return build_tree(acc, num_nodes)


@dataclass(frozen=True)
class MedusaConfig:
    """Shape of a set of Medusa heads, and the candidate tree they draft with.

    guess_vocab: how many token ids the heads guess among (the `vocab` tensor stored with the
    weights, which loading fills in), 0 for the whole vocabulary; see MedusaHeads.restrict_vocab.
    """

    hidden_size: int
    vocab_size: int
    num_heads: int = 4
    num_layers: int = 1
    shared_lm_head: bool = True
    tree: tuple[Path, ...] | None = None
    head_accuracy: tuple[tuple[float, ...], ...] | None = None
    guess_vocab: int = 0

    def __post_init__(self) -> None:
        for name in ("hidden_size", "vocab_size", "num_heads", "num_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"MedusaConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.guess_vocab <= self.vocab_size:
            raise ValueError(f"MedusaConfig.guess_vocab must be 0 (the whole vocabulary) or a token "
                             f"count <= vocab_size {self.vocab_size}, got {self.guess_vocab}")
        if self.tree is not None:
            tree = Tree(tuple(tuple(p) for p in self.tree))
            if tree.max_depth > self.num_heads:
                raise ValueError(f"the tree is {tree.max_depth} deep but there are only "
                                 f"{self.num_heads} heads; use a tree of depth <= num_heads")
            object.__setattr__(self, "tree", tree.paths)
        if self.head_accuracy is not None:
            object.__setattr__(self, "head_accuracy",
                               tuple(tuple(float(a) for a in row) for row in self.head_accuracy))

    def to_dict(self) -> dict:
        return {"hidden_size": self.hidden_size, "vocab_size": self.vocab_size,
                "num_heads": self.num_heads, "num_layers": self.num_layers,
                "shared_lm_head": self.shared_lm_head,
                "tree": [list(p) for p in self.tree] if self.tree is not None else None,
                "head_accuracy": [list(r) for r in self.head_accuracy] if self.head_accuracy else None,
                "guess_vocab": self.guess_vocab}

    @classmethod
    def from_dict(cls, d: dict) -> "MedusaConfig":
        tree = d.get("tree")
        acc = d.get("head_accuracy")
        return cls(hidden_size=int(d["hidden_size"]), vocab_size=int(d["vocab_size"]),
                   num_heads=int(d["num_heads"]), num_layers=int(d["num_layers"]),
                   shared_lm_head=bool(d["shared_lm_head"]),
                   tree=tuple(tuple(p) for p in tree) if tree is not None else None,
                   head_accuracy=tuple(tuple(r) for r in acc) if acc else None,
                   guess_vocab=int(d.get("guess_vocab", 0)))  # absent in heads saved before it


class ResBlock(nn.Module):
    """x + SiLU(W x + b), with W and b zero-initialised: the block starts as the identity."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """K Medusa heads over a base model's last hidden state; a tree drafter for specdec.generate.

    Decoding options (attributes): `tree` (a specdec.drafters.medusa.tree.Tree), `acceptance` ("auto" = lossless
    rejection sampling when temperature > 0, "lossless", or "typical"), `typical_epsilon`,
    `typical_delta`. At temperature 0 verification is always greedy.
    """

    def __init__(self, config: MedusaConfig, lm_head: nn.Linear | None = None) -> None:
        super().__init__()
        self.config = config
        C, V = config.hidden_size, config.vocab_size
        self.blocks = nn.ModuleList(nn.Sequential(*[ResBlock(C) for _ in range(config.num_layers)])
                                    for _ in range(config.num_heads))
        self.lm_heads = None
        if not config.shared_lm_head:
            self.lm_heads = nn.ModuleList(nn.Linear(C, V, bias=False) for _ in range(config.num_heads))
            if lm_head is not None:
                for head in self.lm_heads:
                    head.weight.data.copy_(lm_head.weight.data)
        # (V',) token ids the heads guess among, or None for all; a buffer, saved with the weights
        self.register_buffer("vocab", torch.zeros(config.guess_vocab, dtype=torch.long)
                             if config.guess_vocab else None)
        self._base: list[nn.Linear] = []  # a list: the base LM head is not a parameter of the heads
        self._rows: tuple[tuple, torch.Tensor] | None = None  # (key, LM-head rows of `vocab`): _base_rows
        self._tree: Tree | None = None  # built from config.tree on first use: see `tree`
        if lm_head is not None:
            self.bind(lm_head)
        if config.tree is None:
            self.config = replace(config, tree=default_tree(config.num_heads))
        self.acceptance = "auto"
        self.typical_epsilon = 0.09
        self.typical_delta = 0.3

    def bind(self, lm_head: nn.Module) -> None:
        """Use `lm_head` (the base model's, frozen: an nn.Linear, or a quantized linear of
        `runtime.qlinear` / `runtime.blockq`) as the shared LM head."""
        shape = (lm_head.out_features, lm_head.in_features)
        if shape != (self.config.vocab_size, self.config.hidden_size):
            raise ValueError(f"the LM head is {shape}, the heads need "
                             f"({self.config.vocab_size}, {self.config.hidden_size})")
        self._base = [lm_head]
        self._rows = None

    @property
    def tree(self) -> Tree:
        """The candidate tree the heads draft with, built from `config.tree` (its one copy)."""
        if self._tree is None or self._tree.paths != self.config.tree:
            self._tree = Tree(self.config.tree)
        return self._tree

    def set_tree(self, paths, head_accuracy=None) -> None:
        """Draft with the sparse tree `paths` (list of top-k rank tuples), stored in `config.tree`;
        `head_accuracy` (per head, per rank) is stored too when given: the table the tree was
        built from (specdec.drafters.medusa.tree.build_tree)."""
        changes = {"tree": tuple(tuple(int(r) for r in p) for p in paths)}
        if head_accuracy is not None:
            changes["head_accuracy"] = tuple(tuple(float(a) for a in row) for row in head_accuracy)
        self.config = replace(self.config, **changes)  # MedusaConfig validates the depth

    def restrict_vocab(self, ids: torch.Tensor | None) -> None:
        """Guess only among the token `ids` (1-D), e.g. those the training answers use: heads
        trained with `vocab="data"` never learned to rank the rest, and scoring fewer rows of a
        large LM head is cheaper. None: the whole vocabulary. The target still verifies every
        guess with its full vocabulary, so decoding stays lossless."""
        if ids is not None:
            with torch.inference_mode(False):  # a plain tensor, with a version counter, in any mode
                ids = torch.unique(torch.as_tensor(ids, dtype=torch.long).detach().cpu())  # sorted, no repeats
            if ids.dim() != 1 or ids.numel() == 0:
                raise ValueError(f"restrict_vocab needs a non-empty 1-D set of token ids, got shape "
                                 f"{tuple(ids.shape)}")
            bad = ids[(ids < 0) | (ids >= self.config.vocab_size)]
            if bad.numel():
                raise ValueError(f"restrict_vocab: token id {int(bad[0])} is outside the vocabulary "
                                 f"[0, {self.config.vocab_size})")
            ids = ids.to(next(self.parameters()).device)
        self.vocab = ids
        self._rows = None
        self.config = replace(self.config, guess_vocab=0 if ids is None else ids.numel())

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    def features(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """Hidden states (..., C) -> the residual-block output (K', ..., C) of the first K' =
        `num_heads` heads (default all): a shallow tree needs only as many heads as it is deep."""
        x = hidden.to(self.blocks[0][0].linear.weight.dtype)
        return torch.stack([blk(x) for blk in self.blocks[:num_heads]])

    def head_logits(self, feats: torch.Tensor, vocab: torch.Tensor | None = None) -> torch.Tensor:
        """Residual-block outputs (K, ..., C) -> logits (K, ..., V), or (K, ..., len(vocab)) for
        the token ids `vocab` only (training restricted to the tokens its data holds)."""
        if self.lm_heads is not None:
            ws = [head.weight if vocab is None else head.weight[vocab] for head in self.lm_heads[:len(feats)]]
            return torch.stack([f.to(w.dtype) @ w.T for w, f in zip(ws, feats)])
        return self.base_logits(feats, vocab)

    def base_logits(self, hidden: torch.Tensor, vocab: torch.Tensor | None = None) -> torch.Tensor:
        """The base model's LM head on (..., C): logits (..., V), or (..., len(vocab)). Passing the
        heads' own `self.vocab` reuses its gathered rows; any other id tensor gathers afresh."""
        if not self._base:
            raise RuntimeError("these Medusa heads are not bound to a model's LM head; call "
                               "heads.bind(model.lm_head) or distill.load_medusa")
        base = self._base[0]
        if vocab is None:
            if not isinstance(base, nn.Linear):  # a quantized head runs its own kernel
                return base(hidden)
            w = base.weight  # (V, C)
        elif vocab is self.vocab:
            w = self._base_rows()  # (V', C)
        else:
            w = _head_rows(base, vocab)  # (V', C)
        return hidden.to(w.dtype) @ w.T

    def _base_rows(self) -> torch.Tensor:
        """The base LM head's rows for the guess vocabulary (V', C), gathered once and kept until
        the weight or the id set changes (storage, in-place version, dtype, device): a gather per
        decoding step would copy them every step."""
        base, ids = self._base[0], self.vocab
        w = base.weight if isinstance(base, nn.Linear) else next(iter(base.buffers()))  # what changes with it
        key = (w.data_ptr(), _version(w), w.dtype, w.device, ids.data_ptr(), _version(ids))
        if self._rows is None or self._rows[0] != key:
            # a plain (not inference-mode) tensor without autograd history, whichever mode asks
            with torch.inference_mode(False), torch.no_grad():
                self._rows = (key, _head_rows(base, ids).detach())
        return self._rows[1]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states (..., C) -> logits of every head (K, ..., V)."""
        return self.head_logits(self.features(hidden))

    @torch.no_grad()
    def top_tokens(self, hidden: torch.Tensor, k: int, num_heads: int | None = None) -> torch.Tensor:
        """Each head's k best token ids (K', ..., k) from hidden (..., C), best first, among the
        guess vocabulary (restrict_vocab); K' = num_heads (default all)."""
        feats = self.features(hidden, num_heads)  # (K', ..., C)
        idx = self.head_logits(feats, self.vocab).topk(k, dim=-1).indices  # (K', ..., k)
        return idx if self.vocab is None else self.vocab[idx]

    @torch.no_grad()
    def guesses(self, hidden: torch.Tensor, topk: tuple[int, ...]) -> list[torch.Tensor]:
        """Top-k tokens (B, topk[i]) of heads i < len(topk) from hidden (B, C), best first."""
        idx = self.top_tokens(hidden, max(topk), len(topk))  # (D, B, k)
        return [idx[i, :, :topk[i]] for i in range(len(topk))]


def _version(t: torch.Tensor) -> int:
    """In-place modification counter of `t` (inference tensors keep none: 0)."""
    return 0 if t.is_inference() else t._version


def _head_rows(head: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of an LM head's (V, C) weight: gathered from an nn.Linear, dequantized from a
    quantized one (in the dtype of the model's activations, float32 for its norms' dtype unknown)."""
    if isinstance(head, nn.Linear):
        return head.weight[ids]
    if hasattr(head, "rows"):
        return head.rows(ids, torch.float32)
    return head.dequantize(torch.float32)[ids]


def attach_medusa(model, num_heads: int = 4, num_layers: int = 1, shared_lm_head: bool = True,
                  tree=None) -> MedusaHeads:
    """New (zero-initialised) Medusa heads for `model`, float32, on the model's device.

    shared_lm_head: use the base model's frozen LM head for every head (default; these models'
    vocabularies make a separate LM head per head larger than the model). False gives each head
    its own trainable copy of it. tree: candidate paths (default: the shipped tree).
    """
    cfg = model.config
    config = MedusaConfig(cfg.hidden_size, cfg.vocab_size, num_heads=num_heads, num_layers=num_layers,
                          shared_lm_head=shared_lm_head,
                          tree=tuple(tuple(p) for p in tree) if tree is not None else None)
    heads = MedusaHeads(config, model.lm_head)
    return heads.to(device=model.device, dtype=torch.float32)


def choose_tree(heads: MedusaHeads, table: Sequence[Sequence[float]], num_nodes: int) -> tuple[Path, ...]:
    """Give `heads` the `num_nodes`-node tree with the longest expected accepted length under the
    per-head, per-rank accuracy `table` (`specdec.drafters.medusa.tree.build_tree`); the heads' config keeps the
    tree and the table. Returns the tree's paths."""
    paths = build_tree([list(row) for row in table], num_nodes)
    heads.set_tree(paths, head_accuracy=table)
    return heads.config.tree
