"""Sparse candidate trees for Medusa decoding: layout, attention mask, positions, verification.

A tree is a list of paths in Medusa's `mc_sim_7b_63` format: each path is a tuple of top-k
ranks, one per depth; path (0, 2) is the node whose depth-1 token is head 0's top-1 guess and
whose depth-2 token is head 1's top-3 guess. Node 0 is the root: the token already chosen by the
target (the previous step's bonus token). Nodes are ordered by depth, then by path, so a parent
always precedes its children and siblings are ordered by rank (best guess first).

Verification walks the tree from the root. At a node with target distribution p over the next
token, its children are tried in rank order:

- greedy (temperature 0, lossless): accept the child equal to argmax p;
- typical (lossy, Cai et al. 2024): accept the first child x with p(x) > min(epsilon,
  delta * exp(-H(p)));
- lossless (recursive rejection sampling over siblings): the draft is deterministic (q one-hot),
  so child x is accepted when u < p(x); otherwise p(x) is set to 0 and p renormalised before
  the next sibling. If every child is rejected the bonus token is drawn from what is left of p,
  so each emitted token is distributed exactly as p.

The walk stops at a node whose children are all rejected (or at a leaf); one bonus token is then
drawn from that node's distribution.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from runtime.attention import block_mask_keys
from specdec.sampling import probs_from_logits

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
    (`specdec.medusa` passes the (N, N) ancestor block to the model as `block_mask` instead, which
    builds the same mask, or runs compiled.)
    """
    n = tree.num_nodes
    anc = tree.ancestors(lengths.device) if anc is None else anc  # (N, N)
    positions = tree_positions(tree, lengths)  # (B, N)
    return block_mask_keys(lengths, anc.expand(len(lengths), n, n), num_keys, positions, window)


def tree_tokens(tree: Tree, root: torch.Tensor, guesses: list[torch.Tensor]) -> torch.Tensor:
    """(B, N) tokens of the tree: the root (B,) then, per node, head (depth-1)'s guess at its rank.

    guesses[i]: (B, k_i) head i's top-k tokens, best first, k_i >= tree.topk[i].
    """
    cols = [root[:, None]]
    for p in tree.paths:
        cols.append(guesses[len(p) - 1][:, p[-1]:p[-1] + 1])
    return torch.cat(cols, dim=1)


@dataclass
class Verdict:
    """One row's verification: accepted nodes (root excluded, in order), their tokens, the bonus
    token, and per-depth counts (attempted[d] = depth d+1 was tried, accepted[d] = it passed)."""

    nodes: list[int]
    tokens: list[int]
    bonus: int
    attempted: list[int]
    accepted: list[int]


def _verdict(tree: Tree, row_tokens: list[int], nodes: list[int], bonus: int) -> Verdict:
    depth = len(nodes)
    last = nodes[-1] if nodes else 0
    tried = depth + (1 if tree.children[last] else 0)
    attempted = [1 if d < tried else 0 for d in range(tree.max_depth)]
    accepted = [1 if d < depth else 0 for d in range(tree.max_depth)]
    return Verdict(nodes, [row_tokens[i] for i in nodes], bonus, attempted, accepted)


def verify_greedy(tree: Tree, tokens: torch.Tensor, logits: torch.Tensor,
                  anc: torch.Tensor | None = None) -> list[Verdict]:
    """Greedy verification of tokens (B, N) against target logits (B, N, V): the deepest node
    whose every ancestor equals the target's argmax after its parent."""
    anc = tree.ancestors(tokens.device) if anc is None else anc  # (N, N)
    best = logits.argmax(-1)  # (B, N)
    parent = torch.tensor(tree.parent, device=tokens.device).clamp(min=0)
    match = tokens == best[:, parent]  # (B, N)
    match[:, 0] = True
    ok = ~((~match)[:, None, :] & anc[None]).any(-1)  # (B, N): whole path to the node matches
    depth = torch.tensor(tree.depth, device=tokens.device)
    deepest = (ok * (depth[None] + 1)).argmax(-1)  # (B,) the accepted node of greatest depth
    out = []
    rows_tokens, bonus = tokens.tolist(), best.gather(1, deepest[:, None])[:, 0].tolist()
    for b, node in enumerate(deepest.tolist()):
        out.append(_verdict(tree, rows_tokens[b], tree.path_to(node), bonus[b]))
    return out


def _walk(tree: Tree, tokens: torch.Tensor, logits: torch.Tensor, temperature: float, top_k: int,
          top_p: float, choose, generator: torch.Generator | None) -> list[Verdict]:
    """Walk each row's tree from the root: `choose(p, children_tokens)` returns the index of the
    accepted child (it may edit p in place to the residual) or None; the bonus token is then
    sampled from p at the last accepted node."""
    out = []
    for b, row in enumerate(tokens.tolist()):
        node, nodes = 0, []
        while True:
            p = probs_from_logits(logits[b, node], temperature, top_k, top_p)  # (V,)
            children = tree.children[node]
            pick = choose(p, [row[c] for c in children])
            if pick is None:
                bonus = int(torch.multinomial(p, 1, generator=generator))
                break
            node = children[pick]
            nodes.append(node)
        out.append(_verdict(tree, row, nodes, bonus))
    return out


def verify_typical(tree: Tree, tokens: torch.Tensor, logits: torch.Tensor, temperature: float,
                   top_k: int, top_p: float, epsilon: float, delta: float,
                   generator: torch.Generator | None) -> list[Verdict]:
    """Typical acceptance (lossy): follow the first child x with p(x) > min(epsilon,
    delta * exp(-H(p))); the bonus token is sampled from p at the last accepted node."""
    def choose(p: torch.Tensor, xs: list[int]) -> int | None:
        entropy = -(p * torch.log(p.clamp_min(1e-30))).sum()
        threshold = min(epsilon, delta * float(torch.exp(-entropy)))
        return next((i for i, x in enumerate(xs) if float(p[x]) > threshold), None)

    return _walk(tree, tokens, logits, temperature, top_k, top_p, choose, generator)


def verify_lossless(tree: Tree, tokens: torch.Tensor, logits: torch.Tensor, temperature: float,
                    top_k: int, top_p: float, generator: torch.Generator | None) -> list[Verdict]:
    """Recursive rejection sampling over siblings (lossless): each child x in rank order is
    accepted with probability p(x) (q is one-hot); on rejection p(x) <- 0 and p is renormalised;
    when every child fails the bonus token is sampled from the residual p."""
    def choose(p: torch.Tensor, xs: list[int]) -> int | None:
        for i, x in enumerate(xs):
            u = float(torch.rand((), generator=generator, device=p.device))
            if u < float(p[x]):
                return i
            p[x] = 0.0
            p.div_(p.sum())  # positive: a rejection means p(x) < 1
        return None

    return _walk(tree, tokens, logits, temperature, top_k, top_p, choose, generator)
