"""Greedy Medusa tau of any tree, replayed from one plain decoding pass (teacher forcing).

At temperature 0 Medusa decoding emits exactly the plain greedy continuation, and each step's
heads read the hidden state of the last accepted token, which is the plain pass's hidden state
at that position. One plain pass that records its hidden states (`specdec.capture.StateCapture`)
therefore gives every position's head guesses, and walking a tree over them gives that tree's
tau, target forwards and per-depth acceptance without running the tree (on a CPU, where a large
tree step over many rows is thousands of tokens, one plain pass instead of one run per tree).

The replay equals a real run in float32 (tests/specdec/tuning/test_medusa_replay.py) and differs in bf16
only where a tree step's rounding flips a near-tie. It predicts; a real run is still what a tau
figure reports. Build the trees from held-out data (`build_tree` on the heads' accuracy table),
not from the prompts replayed, or the prediction is tuned on its own test set.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec.capture import StateCapture
from specdec.drafters.medusa.heads import MedusaHeads
from specdec.drafters.medusa.tree import Tree
from specdec.generate import generate
from specdec.stats import step_counts


@dataclass
class ReplayCounts:
    """One tree's totals over the replayed rows, counted as `AcceptanceStats` counts them."""

    generated_tokens: int = 0
    target_forwards: int = 0
    attempted: list[int] = field(default_factory=list)  # per depth: steps that tried it
    accepted: list[int] = field(default_factory=list)  # per depth: steps that accepted it

    @property
    def tau(self) -> float:
        return self.generated_tokens / self.target_forwards if self.target_forwards else 0.0

    def to_dict(self) -> dict:
        return {"tau": self.tau, "generated_tokens": self.generated_tokens,
                "target_forwards": self.target_forwards, "accepted_tokens": sum(self.accepted),
                "per_position_acceptance": [a / t if t else 0.0 for a, t in zip(self.accepted, self.attempted)]}


def guess_ranks(heads: MedusaHeads, hidden: torch.Tensor, seq: torch.Tensor, start: int, depth: int,
                k: int) -> torch.Tensor:
    """Rank (0..k-1, or -1 when not among the k best) of the true token in head d's guesses at
    each position p = start + i: head d on hidden[i] guesses seq[p + 2 + d] (the root, seq[p + 1],
    is the target's own choice). hidden (n, C), seq (T,) -> (n, depth)."""
    top = heads.top_tokens(hidden, k, depth).cpu()  # (D, n, k)
    T, n = seq.numel(), hidden.shape[0]
    out = torch.full((n, depth), -1, dtype=torch.long)
    for d in range(depth):
        pos = torch.arange(start, start + n) + 2 + d  # (n,) positions the guesses are for
        hit = top[d] == seq[pos.clamp(max=T - 1)][:, None]  # (n, k)
        found = hit.any(-1) & (pos < T)
        out[:, d] = torch.where(found, hit.float().argmax(-1), torch.full_like(pos, -1))
    return out


def replay_row(tree: Tree, ranks: torch.Tensor, new_tokens: int, counts: ReplayCounts,
               max_new_tokens: int | None = None) -> None:
    """Walk one row's decoding steps through `tree` and add them to `counts`. ranks (n, D) from
    guess_ranks, n = new_tokens: row i belongs to the step whose last accepted token is new
    token i - 1 (i = 0: the last prompt token). As in the decode loop, a step verifies no
    draft deeper than the tokens the row may still emit (max_new_tokens, default new_tokens)
    minus the one the target adds."""
    paths = set(tree.paths)
    parents = {p[:-1] for p in tree.paths}  # prefixes with children (() = the root)
    D = tree.max_depth
    if not counts.attempted:
        counts.attempted, counts.accepted = [0] * D, [0] * D
    counts.generated_tokens += 1  # the prefill chooses the root
    counts.target_forwards += 1
    emitted, i = 1, 0
    limit = new_tokens if max_new_tokens is None else max_new_tokens
    while emitted < new_tokens:
        depth = min(D, limit - emitted - 1)  # the deepest draft this step verifies
        prefix: tuple[int, ...] = ()
        while len(prefix) < depth and prefix + (int(ranks[i, len(prefix)]),) in paths:
            prefix += (int(ranks[i, len(prefix)]),)
        a = len(prefix)
        tried = a + (1 if prefix in parents and a < depth else 0)
        step = min(a + 1, new_tokens - emitted)  # tokens emitted: an eos may end the row inside the path
        _, tried, kept = step_counts(tried, tried, a, step)  # as the decode loop counts it
        for d in range(tried):
            counts.attempted[d] += 1
        for d in range(kept):
            counts.accepted[d] += 1
        counts.generated_tokens += step
        counts.target_forwards += 1
        emitted += a + 1
        i += 1 + a


@torch.inference_mode()
def replay_tau(model, heads: MedusaHeads, rows: list[torch.Tensor], trees: dict[str, Tree],
               max_new_tokens: int, eos_token_id: int | list[int] | None = None) -> dict[str, ReplayCounts]:
    """Greedy Medusa counts of each tree in `trees` (name -> Tree) on the prompts `rows` (1-D
    token ids), from one batched plain greedy pass; no tree may be deeper than there are heads."""
    depth = max(t.max_depth for t in trees.values())
    if depth > heads.num_heads:
        raise ValueError(f"a tree is {depth} deep but there are only {heads.num_heads} heads")
    k = max(max(t.topk) for t in trees.values())
    capture = StateCapture(hidden=True)
    plain = generate(model, rows, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, observer=capture)
    counts = {name: ReplayCounts() for name in trees}
    for prompt, seq, hidden in zip(rows, plain.sequences, capture.hidden_states):
        seq = seq.cpu()
        ranks = guess_ranks(heads, hidden, seq, prompt.numel() - 1, depth, k)  # (n, D)
        for name, tree in trees.items():
            replay_row(tree, ranks, seq.numel() - prompt.numel(), counts[name], max_new_tokens)
    return counts
