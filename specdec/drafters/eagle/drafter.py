"""EAGLE-3 heads as a drafter: an EAGLE-2 dynamic draft tree grown in the head's feature space.

Each step the head first catches up on what the target verified: one head forward over the
target's aux states behind the root and the accepted drafts (from the verification forward
itself, `Drafter.hidden_layers`; at the start, every prompt position), paired with the tokens
that follow them. Its output at the root starts the tree (EAGLE-2, Li et al. 2024):

- depth 1: the head's top_k tokens after the root;
- depth d + 1: the top_k nodes of depth d by cumulative log-probability are fed to the head
  together (each attends to the committed cache and its own ancestors) and each proposes its
  top_k children;
- rerank: of every candidate (top_k + (depth - 1) * top_k^2), keep the total_tokens best by
  cumulative log-probability. A child never scores above its parent, so the kept set is a tree;
  in score order (stable, so ties keep a parent first) parents precede children and siblings
  come best first. A tree of N nodes is grown with depth and top_k capped at N
  (`EagleTreeConfig.trimmed`): the same kept nodes, far fewer head rows for small trees.

The tree is a deterministic function of the context (top-k, no sampling), so its q is one-hot
(`DraftTree.q = None`) and `specdec.verify` is lossless at any temperature: greedy outputs equal
plain decoding, sampled ones follow the target's law (the verifier accepts a child x with
probability p(x) and otherwise zeroes p(x) before the next sibling). Sampled drafts with their
q would not be: the rerank keeps a node depending on the token drawn, which biases its law.
The head's tree entries are dropped after each proposal (a length change).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.model import Transformer
from specdec.drafter import Accepted, Drafter, DraftTree
from specdec.drafters.eagle.head import Eagle3Head

# the tree sizes `eagle:DIR@auto` times (specdec.tuning.eagle_tree), those a depth x top_k tree can hold
AUTO_TREE_SIZES = (2, 4, 8, 12, 16, 24, 32, 48, 64)


@dataclass(frozen=True)
class EagleTreeConfig:
    """Shape of the dynamic tree: `depth` levels, `top_k` children per expanded node and `top_k`
    nodes expanded per level, `total_tokens` nodes kept after the rerank (what the target scores)."""

    depth: int = 5
    top_k: int = 8
    total_tokens: int = 48

    def __post_init__(self) -> None:
        for name in ("depth", "top_k", "total_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"EagleTreeConfig.{name} must be an integer >= 1, got {value!r}")
        if self.total_tokens > self.candidates:
            raise ValueError(f"EagleTreeConfig.total_tokens ({self.total_tokens}) exceeds the {self.candidates} "
                             f"candidates a tree of depth {self.depth} and top_k {self.top_k} grows")

    @property
    def candidates(self) -> int:
        """Nodes grown before the rerank: top_k + (depth - 1) * top_k^2."""
        return self.top_k + (self.depth - 1) * self.top_k ** 2

    def trimmed(self) -> EagleTreeConfig:
        """The smallest shape that keeps the same total_tokens nodes: the N best candidates form a
        tree of depth <= N, and each of them ranks within the N best of its level and of its
        siblings, so a depth or top_k above N only grows candidates the rerank drops."""
        n = self.total_tokens
        return EagleTreeConfig(min(self.depth, n), min(self.top_k, n), n)


class EagleDrafter(Drafter):
    """Drafts a dynamic tree with an EAGLE-3 head that reads `target`'s aux layers; k is ignored."""

    name = "eagle"
    adaptive = False

    def __init__(self, head: Eagle3Head, target, tree: EagleTreeConfig | None = None) -> None:
        cfg, tc = head.config, target.config
        if not isinstance(target, Transformer):  # it reads the target's layers, embedding and attention
            raise ValueError("an EAGLE-3 head reads the target's hidden states: the target must be a runtime "
                             "Transformer (runtime.load_model), not a transformers model")
        if (cfg.hidden_size, cfg.vocab_size) != (tc.hidden_size, tc.vocab_size) or max(cfg.aux_layers) >= tc.num_layers:
            raise ValueError(f"this EAGLE-3 head (hidden size {cfg.hidden_size}, vocabulary {cfg.vocab_size}, aux "
                             f"layers {cfg.aux_layers}) was not made for a target with hidden size {tc.hidden_size}, "
                             f"vocabulary {tc.vocab_size} and {tc.num_layers} layers")
        self.head, self.target, self.tree = head, target, tree or EagleTreeConfig()
        head.attention = target.attention  # the head drafts with its target's attention backend
        self.hidden_layers = cfg.aux_layers
        self.cache = None
        self.pending: list[torch.Tensor] = []  # per row (m, 3C): target aux states the head has not read
        self.last: torch.Tensor | None = None  # (B, C): the head's output at each row's root

    @property
    def grown(self) -> EagleTreeConfig:
        """The shape actually grown (`EagleTreeConfig.trimmed`): the same kept tree, fewer candidates."""
        return self.tree.trimmed()

    def max_nodes(self, k: int) -> int:
        return self.tree.total_tokens

    def begin(self, prompts: list[torch.Tensor], max_len: int, hidden: torch.Tensor | None) -> None:
        t = self.grown
        room = max_len + (t.depth - 1) * t.top_k + t.depth + 2  # + the tree's entries + a catch-up's padding
        self.cache = self.head.new_cache(len(prompts), room)
        self.pending = [hidden[b, :p.numel()] for b, p in enumerate(prompts)]
        self.last = torch.zeros(len(prompts), self.head.config.hidden_size, dtype=self.head.dtype,
                                device=self.head.device)

    def reserve(self, batch_size: int, max_len: int) -> None:
        t = self.grown
        # twice the target's length: a newcomer's catch-up over its whole prompt pads the other rows to it
        room = 2 * max_len + (t.depth - 1) * t.top_k + t.depth + 2
        self.cache = self.head.new_cache(batch_size, room)
        C = self.head.config.hidden_size
        empty = torch.zeros(0, 3 * C, dtype=self.head.dtype, device=self.head.device)
        self.pending = [empty] * batch_size
        self.last = torch.zeros(batch_size, C, dtype=self.head.dtype, device=self.head.device)

    def admit(self, row: int, prompt: torch.Tensor, hidden: torch.Tensor | None) -> None:
        """The row's prompt states (T, 3C) wait for the next catch-up, as `begin`'s do."""
        self.cache.lengths[row] = 0
        self.pending[row] = hidden[:prompt.numel()]

    def release(self, row: int) -> None:
        self.cache.lengths[row] = 0
        self.pending[row] = self.pending[row][:0]

    def propose(self, seqs: list[torch.Tensor], k: int, rows: list[int]) -> DraftTree:
        self._catch_up(seqs, rows)
        return self._grow(seqs, rows)

    def commit(self, accepted: Accepted) -> None:
        hidden = accepted.hidden  # (B, 1 + N, 3C)
        self.pending = [hidden[b, [0] + [1 + i for i in path]] for b, path in enumerate(accepted.paths)]

    def _catch_up(self, seqs: list[torch.Tensor], rows: list[int]) -> None:
        """Feed each row's pending target states with the tokens that follow them (the last m of its
        sequence, at their positions) into the head's cache; keep the output at the root."""
        head, B, device = self.head, len(seqs), self.head.device
        m = [self.pending[b].shape[0] if b in rows else 0 for b in range(B)]
        T = max(m)
        if T == 0:
            return
        aux = torch.zeros(B, T, 3 * head.config.hidden_size, dtype=head.dtype, device=device)  # (B, T, 3C)
        tokens = torch.zeros(B, T, dtype=torch.long)  # (B, T)
        positions = torch.zeros(B, T, dtype=torch.long)  # (B, T)
        for b in range(B):
            n = seqs[b].numel()
            if m[b]:
                aux[b, :m[b]] = self.pending[b]
                tokens[b, :m[b]] = seqs[b][n - m[b]:]
            positions[b] = torch.arange(n - m[b], n - m[b] + T)  # padding continues past the row's end
        positions = positions.clamp(max=head.config.max_position_embeddings - 1).to(device)
        start = self.cache.lengths.clone()  # (B,)
        out = head.step(head.fuse(aux), self.target.embed(tokens.to(device)), positions, self.cache)  # (B, T, C)
        self.cache.rollback(start + torch.tensor(m, device=start.device))
        for b in range(B):
            if m[b]:
                self.last[b] = out[b, m[b] - 1]
                self.pending[b] = self.pending[b][:0]

    def _grow(self, seqs: list[torch.Tensor], rows: list[int]) -> DraftTree:
        """The EAGLE-2 tree of every row from the head's output at its root (see the module docstring)."""
        head, cache, device = self.head, self.cache, self.head.device
        K, D, N = self.grown.top_k, self.grown.depth, self.grown.total_tokens
        B, C = self.last.shape
        committed = cache.lengths.clone()  # (B,)
        root_pos = torch.tensor([s.numel() - 1 for s in seqs], device=device)  # (B,)
        last_pos = head.config.max_position_embeddings - 1
        top = _log_probs(head, self.last).topk(K)  # (B, K) from (B, Vd)
        scores, tokens, parents = [top.values], [top.indices], [torch.full((B, K), -1, device=device)]
        front = torch.arange(K, device=device).expand(B, K)  # (B, K): candidate index of each frontier node
        front_score, front_tok = top.values, top.indices  # (B, K)
        front_hidden = self.last[:, None].expand(B, K, C)  # (B, K, C): what each frontier node reads
        fed = torch.full((B, K + (D - 1) * K * K), -1, dtype=torch.long, device=device)  # candidate -> fed slot
        anc = torch.zeros(B, 0, 0, dtype=torch.bool, device=device)  # (B, F, F): ancestors among fed nodes
        rows_idx = torch.arange(B, device=device)[:, None]  # (B, 1)
        for d in range(1, D):
            F_prev = anc.shape[1]
            parent = _parent_of(parents, front, K, d)  # (B, K) candidate index, -1 = the root
            parent_fed = torch.where(parent >= 0, fed.gather(1, parent.clamp(min=0)), -1)  # (B, K)
            new = torch.zeros(B, K, F_prev + K, dtype=torch.bool, device=device)  # (B, K, F + K)
            if F_prev:
                new[:, :, :F_prev] = anc[rows_idx, parent_fed.clamp(min=0)] & (parent_fed >= 0)[:, :, None]
            new[:, torch.arange(K), F_prev + torch.arange(K)] = True
            anc = torch.cat([torch.nn.functional.pad(anc, (0, K)), new], dim=1)  # (B, F + K, F + K)
            mask = _tree_mask(committed, new)  # (B, K, S)
            positions = (root_pos + d).clamp(max=last_pos)[:, None].expand(B, K)
            embeds = self.target.embed(head.target_ids(front_tok))  # (B, K, C)
            out = head.step(front_hidden, embeds, positions, cache, mask)  # (B, K, C)
            fed.scatter_(1, front, F_prev + torch.arange(K, device=device).expand(B, K))
            child = _log_probs(head, out).topk(K)  # (B, K, K) from (B, K, Vd)
            child_score = (front_score[:, :, None] + child.values).reshape(B, K * K)
            scores.append(child_score)
            tokens.append(child.indices.reshape(B, K * K))
            parents.append(front[:, :, None].expand(B, K, K).reshape(B, K * K))
            best = child_score.topk(K).indices  # (B, K): the next frontier, among the new candidates
            base = K + (d - 1) * K * K
            front = base + best
            front_score, front_tok = child_score.gather(1, best), tokens[-1].gather(1, best)
            front_hidden = out.gather(1, (best // K)[:, :, None].expand(B, K, C))
        cache.rollback(committed)
        return _rerank(head, torch.cat(scores, 1), torch.cat(tokens, 1), torch.cat(parents, 1), N, rows)


def _parent_of(parents: list[torch.Tensor], front: torch.Tensor, K: int, d: int) -> torch.Tensor:
    """(B, K): the candidate index of each frontier node's parent (-1 at depth 1)."""
    if d == 1:
        return torch.full_like(front, -1)
    base = K + (d - 2) * K * K  # first candidate index of the last level
    return parents[-1].gather(1, front - base)


def _log_probs(head: Eagle3Head, hidden: torch.Tensor) -> torch.Tensor:
    """Draft-vocabulary log-probabilities (float32, <= 0) of the head's output states (..., C)."""
    return torch.log_softmax(head.logits(hidden).float(), dim=-1).clamp(max=0.0)


def _tree_mask(committed: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """(B, K, S) bool over the head's cache slots for K new tree nodes: every committed slot of the
    row, and the fed tree nodes `new` (B, K, F) marks (written from slot committed[b] on)."""
    B, K, F = new.shape
    S = int(committed.max()) + F
    slot = torch.arange(S, device=committed.device)  # (S,)
    rel = slot[None] - committed[:, None]  # (B, S): index among the tree's fed nodes
    in_tree = (rel >= 0) & (rel < F)
    tree_part = new.gather(2, rel.clamp(0, F - 1)[:, None].expand(B, K, S))  # (B, K, S)
    return (rel < 0)[:, None] | (in_tree[:, None] & tree_part)


def _rerank(head: Eagle3Head, scores: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, n: int,
            rows: list[int]) -> DraftTree:
    """The n best candidates (B, n) by score as a DraftTree: in stable score order, so a parent (never
    below its child, generated before it) precedes its children and siblings come best first."""
    B = scores.shape[0]
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :n]  # (B, n)
    rank = torch.full_like(scores, -1, dtype=torch.long).scatter_(
        1, order, torch.arange(n, device=scores.device).expand(B, n))  # (B, Ct): new index of each candidate
    par = parents.gather(1, order)  # (B, n)
    new_par = torch.where(par >= 0, rank.gather(1, par.clamp(min=0)), -1)
    lens = torch.zeros(B, dtype=torch.long)
    lens[rows] = n
    return DraftTree(head.target_ids(tokens.gather(1, order)).cpu(), new_par.cpu(), lens)


def from_spec(spec, target, loader) -> EagleDrafter:
    """`eagle:DIR[@N[:DxK]]` or `@auto[:DxK]` (specdec.methods): the head in DIR (loaded once
    per loader) drafting the spec's tree; @auto times tree sizes on the loader's calibration prompts."""
    def build() -> EagleDrafter:
        head = loader.eagle_head(spec.arg, target)
        tree = spec.eagle_tree or loader.eagle_auto_tree(spec, target, head)
        return EagleDrafter(head, target, tree)

    return loader.cached(("eagle", str(spec)), build)
