"""Sparse candidate trees for Medusa heads: layout, construction, attention mask, positions.

A tree is a list of paths in Medusa's `mc_sim_7b_63` format: each path is a tuple of top-k
ranks, one per depth; path (0, 2) is the node whose depth-1 token is head 0's top-1 guess and
whose depth-2 token is head 1's top-3 guess. Node 0 is the root: the token already chosen by the
target (the previous step's bonus token). Nodes are ordered by depth, then by path, so a parent
always precedes its children and siblings are ordered by rank (best guess first).
`specdec.drafters.medusa.drafter` lays the heads' guesses out in this order as a `DraftTree`, and
`specdec.verify` verifies it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from specdec.drafter import DraftTree

Path = tuple[int, ...]


def normalize_paths(paths) -> tuple[Path, ...]:
    """Paths as sorted tuples (by depth, then ranks), with every missing prefix added."""
    out: set[Path] = set()
    for p in paths:
        p = tuple(int(r) for r in p)
        if not p:
            raise ValueError("a tree path must be non-empty (the root is implicit)")
        if min(p) < 0:
            raise ValueError(f"tree path {p} holds a negative top-k rank")
        for d in range(1, len(p) + 1):
            out.add(p[:d])
    return tuple(sorted(out, key=lambda q: (len(q), q)))


@dataclass(frozen=True)
class Tree:
    """A sparse candidate tree (root implicit) and its index tables."""

    paths: tuple[Path, ...]
    parent: tuple[int, ...] = field(init=False)
    depth: tuple[int, ...] = field(init=False)
    topk: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        if not self.paths:
            raise ValueError("a tree needs at least one path, e.g. [(0,)]")
        paths = normalize_paths(self.paths)
        index = {(): 0}
        parent, depth = [-1], [0]
        for i, p in enumerate(paths, start=1):
            index[p] = i
            parent.append(index[p[:-1]])
            depth.append(len(p))
        max_depth = max(depth)
        topk = [0] * max_depth
        for p in paths:
            topk[len(p) - 1] = max(topk[len(p) - 1], p[-1] + 1)
        object.__setattr__(self, "paths", paths)
        object.__setattr__(self, "parent", tuple(parent))
        object.__setattr__(self, "depth", tuple(depth))
        object.__setattr__(self, "topk", tuple(topk))

    @property
    def num_nodes(self) -> int:
        """Nodes including the root: the tokens one verification forward scores."""
        return len(self.parent)

    @property
    def max_depth(self) -> int:
        """Draft tokens on the longest path: the number of Medusa heads the tree uses."""
        return len(self.topk)

    @cached_property
    def layout(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The tree as draft nodes (the root excluded; node i is tree node i + 1), computed once:
        parents (N-1,) with -1 = the root, depths (N-1,), and the (N, N) ancestor mask over
        [root, nodes] (the DraftTree's block_mask)."""
        n = self.num_nodes - 1
        parents = torch.tensor(self.parent[1:], dtype=torch.long) - 1
        tree = DraftTree(torch.zeros(1, n, dtype=torch.long), parents[None], torch.tensor([n]))
        return parents, tree.depths()[0], tree.block_mask()[0]


def expected_length(paths, accuracy: list[list[float]]) -> float:
    """Expected accepted draft tokens per step: sum over nodes of the product of the per-depth
    probabilities that head d's rank-r guess is right (heads assumed independent)."""
    total = 0.0
    for p in normalize_paths(paths):
        prob = 1.0
        for d, r in enumerate(p):
            prob *= accuracy[d][r] if d < len(accuracy) and r < len(accuracy[d]) else 0.0
        total += prob
    return total


def build_tree(accuracy: list[list[float]], num_nodes: int) -> tuple[Path, ...]:
    """Greedy sparse tree of `num_nodes` nodes (root excluded) maximising the expected accepted
    length, from accuracy[i][r] = P(head i's rank-r top-k guess is the true token).

    A child never scores above its parent, so adding the best frontier node each time keeps the
    tree prefix-closed; for this additive objective greedy is optimal (Medusa's construction).
    """
    if num_nodes < 1:
        raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
    if not accuracy or not all(accuracy):
        raise ValueError("accuracy must hold, for every head, the accuracy of each top-k rank")
    chosen: list[Path] = []
    frontier: dict[Path, float] = {(r,): float(a) for r, a in enumerate(accuracy[0])}
    while frontier and len(chosen) < num_nodes:
        best = max(frontier, key=lambda p: (frontier[p], -len(p)))
        score = frontier.pop(best)
        chosen.append(best)
        d = len(best)
        if d < len(accuracy):
            for r, a in enumerate(accuracy[d]):
                frontier[best + (r,)] = score * float(a)
    return normalize_paths(chosen)


def draft_tree(tree: Tree, guesses: list[torch.Tensor], rows: list[int] | None = None) -> DraftTree:
    """The heads' guesses laid out on `tree` as a DraftTree (the root excluded: draft node i is
    tree node i + 1). guesses[d]: (B, k_d) head d's top-k tokens, best first, k_d >= tree.topk[d].
    rows: the rows that draft (default all; the others get no valid node)."""
    tokens = torch.stack([guesses[len(p) - 1][:, p[-1]] for p in tree.paths], dim=1).cpu()  # (B, N)
    B, n = tokens.shape
    parents, depths, mask = tree.layout  # the same every step: views, not copies
    lens = torch.full((B,), n, dtype=torch.long)
    if rows is not None:
        lens.zero_()
        lens[rows] = n
    draft = DraftTree(tokens, parents[None].expand(B, n), lens)
    draft._cache.update(depths=depths[None].expand(B, n), block_mask=mask[None].expand(B, n + 1, n + 1))
    return draft
