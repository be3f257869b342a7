"""Sparse candidate trees for Medusa heads: layout, construction, attention mask, positions.

A tree is a list of paths in Medusa's `mc_sim_7b_63` format: each path is a tuple of top-k
ranks, one per depth; path (0, 2) is the node whose depth-1 token is head 0's top-1 guess and
whose depth-2 token is head 1's top-3 guess. Node 0 is the root: the token already chosen by the
target (the previous step's bonus token). Nodes are ordered by depth, then by path, so a parent
always precedes its children and siblings are ordered by rank (best guess first).
`specdec.drafters.medusa` lays the heads' guesses out in this order as a `DraftTree`, and
`specdec.verify` verifies it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from runtime.attention import block_mask_keys
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
    """A sparse candidate tree (root implicit) and the index tables verification needs."""

    paths: tuple[Path, ...]
    parent: tuple[int, ...] = field(init=False)
    depth: tuple[int, ...] = field(init=False)
    children: tuple[tuple[int, ...], ...] = field(init=False)
    topk: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        if not self.paths:
            raise ValueError("a tree needs at least one path, e.g. [(0,)]")
        paths = normalize_paths(self.paths)
        index = {(): 0}
        parent, depth = [-1], [0]
        children: list[list[int]] = [[]]
        for i, p in enumerate(paths, start=1):
            index[p] = i
            parent.append(index[p[:-1]])
            depth.append(len(p))
            children.append([])
            children[index[p[:-1]]].append(i)
        max_depth = max(depth)
        topk = [0] * max_depth
        for p in paths:
            topk[len(p) - 1] = max(topk[len(p) - 1], p[-1] + 1)
        object.__setattr__(self, "paths", paths)
        object.__setattr__(self, "parent", tuple(parent))
        object.__setattr__(self, "depth", tuple(depth))
        object.__setattr__(self, "children", tuple(tuple(c) for c in children))
        object.__setattr__(self, "topk", tuple(topk))

    @property
    def num_nodes(self) -> int:
        """Nodes including the root: the tokens one verification forward scores."""
        return len(self.parent)

    @property
    def max_depth(self) -> int:
        """Draft tokens on the longest path: the number of Medusa heads the tree uses."""
        return len(self.topk)

    def ancestors(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """(N, N) bool: [i, j] is True when node j is node i or one of its ancestors."""
        n = self.num_nodes
        anc = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            j = i
            while j >= 0:
                anc[i, j] = True
                j = self.parent[j]
        return anc.to(device)

    def path_to(self, node: int) -> list[int]:
        """Nodes from the root's first child down to `node` (the root excluded)."""
        out = []
        while node > 0:
            out.append(node)
            node = self.parent[node]
        return out[::-1]


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


def tree_positions(tree: Tree, lengths: torch.Tensor, max_position: int | None = None) -> torch.Tensor:
    """(B, N) rope positions of the tree tokens: each row's length plus the node depth."""
    depth = torch.tensor(tree.depth, device=lengths.device)
    pos = lengths[:, None] + depth[None]  # (B, N)
    return pos.clamp(max=max_position) if max_position is not None else pos


def tree_mask(tree: Tree, lengths: torch.Tensor, num_keys: int, anc: torch.Tensor | None = None,
              window: int | None = None) -> torch.Tensor:
    """(B, N, S) bool attention mask for the tree written at slots lengths[b] .. lengths[b]+N-1.

    Node i of row b sees the row's cached prefix [0, lengths[b]) and the slots of its own
    ancestors (itself included); every other slot (other branches, other rows' padding) is hidden.
    (The decode loop passes the (N, N) ancestor block to the model as `block_mask` instead, which
    builds the same mask, or runs compiled.)
    """
    n = tree.num_nodes
    anc = tree.ancestors(lengths.device) if anc is None else anc  # (N, N)
    positions = tree_positions(tree, lengths)  # (B, N)
    return block_mask_keys(lengths, anc.expand(len(lengths), n, n), num_keys, positions, window)


def draft_tree(tree: Tree, guesses: list[torch.Tensor], rows: list[int] | None = None) -> DraftTree:
    """The heads' guesses laid out on `tree` as a DraftTree (the root excluded: draft node i is
    tree node i + 1). guesses[d]: (B, k_d) head d's top-k tokens, best first, k_d >= tree.topk[d].
    rows: the rows that draft (default all; the others get no valid node)."""
    tokens = torch.stack([guesses[len(p) - 1][:, p[-1]] for p in tree.paths], dim=1).cpu()  # (B, N)
    B, n = tokens.shape
    parents = (torch.tensor(tree.parent[1:]) - 1)[None].expand(B, n).contiguous()  # (B, N): root = -1
    lens = torch.full((B,), n, dtype=torch.long)
    if rows is not None:
        lens.zero_()
        lens[rows] = n
    return DraftTree(tokens, parents, lens)
