"""A suffix trie of bounded depth over token sequences: what followed each recent context, and how often.

SuffixDecoding (Oliaro et al. 2024, arXiv 2411.04975; ArcticInference and vLLM's `suffix` method)
keeps every substring of up to `depth` tokens of the sequences it has seen, with its number of
occurrences. Here that is a trie holding, for every start position j of every sequence s, the path
s[j : j + depth]: a node's `count` is the number of occurrences of its path, and its children
split the occurrences that have a next token. So after a context whose last m tokens are a path u,
token t followed u in count(u + t) / cont(u) of the cases (`cont`: occurrences of u that have a
next token), and the tree of likely continuations is read off u's subtree.

Appending a token to a sequence extends its (at most `depth`) open windows by one node each, so a
sequence of L tokens costs O(L * depth) time and at most L * depth nodes; `remove` undoes one
sequence's windows (the shared cache's eviction). Pure Python: lookups walk at most `depth` nodes
per step.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass


class TrieNode:
    """count: occurrences of this node's path; cont: those followed by another token inside a window
    (= the sum of the children's counts); children: next token -> node."""

    __slots__ = ("count", "cont", "children")

    def __init__(self) -> None:
        self.count = 0
        self.cont = 0
        self.children: dict[int, TrieNode] = {}


@dataclass(frozen=True)
class Speculation:
    """A tree of continuations: tokens[i] follows its parent (parents[i], -1 = after the context;
    parents precede children, siblings best first), probs[i] is the frequency estimate that the
    whole path down to node i is what comes next, and `score` = sum(probs), the expected number of
    accepted tokens under that estimate. match_len: how many context tokens the continuation was
    matched on."""

    tokens: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()
    probs: tuple[float, ...] = ()
    match_len: int = 0

    @property
    def score(self) -> float:
        return sum(self.probs)


class SuffixTrie:
    """Substrings of up to `depth` tokens of many sequences. A sequence is built in chunks by
    `extend(windows, tokens)`, where `windows` (what the previous call returned, [] for a new
    sequence) are its open windows: the caller keeps them, so nothing is left behind when a
    sequence's owner goes away."""

    def __init__(self, depth: int = 24) -> None:
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 2:
            raise ValueError(f"a suffix trie's depth is an integer >= 2 (a context token and one to propose), "
                             f"got {depth!r}")
        self.depth = depth
        self.root = TrieNode()
        self.nodes = 1

    def extend(self, windows: list[TrieNode], tokens: Sequence[int]) -> list[TrieNode]:
        """Append `tokens` to the sequence whose open windows are `windows` (the nodes of its last
        1, 2, ... depth tokens, shortest first; [] for a new sequence); returns its new windows."""
        for t in tokens:
            windows = self._append(windows, int(t))
        return windows

    def _append(self, windows: list[TrieNode], t: int) -> list[TrieNode]:
        grown = [self._child(self.root, t)]
        for node in windows[:self.depth - 1]:  # a window of `depth` tokens is full
            grown.append(self._child(node, t))
        return grown

    def _child(self, node: TrieNode, t: int) -> TrieNode:
        child = node.children.get(t)
        if child is None:
            child = node.children[t] = TrieNode()
            self.nodes += 1
        child.count += 1
        node.cont += 1
        return child

    def remove(self, tokens: Sequence[int]) -> None:
        """Take sequence `tokens` (all that was appended to one sequence) out of the counts; the
        sequence's open windows must not be extended after this."""
        seq = [int(t) for t in tokens]
        for j in range(len(seq)):
            node = self.root
            for t in seq[j:j + self.depth]:
                child = node.children[t]
                child.count -= 1
                node.cont -= 1
                if child.count == 0:
                    del node.children[t]
                    self.nodes -= _size(child)
                    break
                node = child

    def find(self, pattern: Sequence[int]) -> TrieNode | None:
        """The node of `pattern` (at most `depth` tokens), None when it never occurred."""
        node = self.root
        for t in pattern:
            node = node.children.get(int(t))
            if node is None:
                return None
        return node

    def continuations(self, pattern: Sequence[int]) -> dict[int, int]:
        """Next token -> how often it followed `pattern` (empty when it never did)."""
        node = self.find(pattern)
        return {} if node is None else {t: c.count for t, c in node.children.items()}

    def speculate(self, context: Sequence[int], max_nodes: int, max_factor: float = 1.0,
                  min_prob: float = 0.1, min_match: int = 1) -> Speculation:
        """The best tree of continuations of `context`: for every match length m from min_match up
        to depth - 1 whose last-m-token pattern has continuations, a tree of up to
        min(max_nodes, ceil(max_factor * m)) nodes taken best first by path probability (nodes below
        min_prob are left out); the tree with the highest score wins (ties: the longer match)."""
        best = Speculation()
        tail = [int(t) for t in context[max(0, len(context) - (self.depth - 1)):]]
        for m in range(min_match, len(tail) + 1):
            node = self.find(tail[len(tail) - m:])
            if node is None:
                break  # a longer pattern ends with this one: it never occurred either
            if node.cont == 0:
                continue
            size = min(max_nodes, int(-(-max_factor * m // 1)))
            spec = _best_first(node, size, min_prob, m)
            if spec.score >= best.score and spec.tokens:
                best = spec
        return best


def _best_first(node: TrieNode, size: int, min_prob: float, match_len: int) -> Speculation:
    """Up to `size` nodes of `node`'s subtree, most probable paths first."""
    tokens, parents, probs = [], [], []
    heap: list[tuple[float, int, int, int, TrieNode]] = []  # (-prob, tie, parent index, token, node)
    tie = 0

    def push(parent: TrieNode, index: int, prob: float) -> None:
        nonlocal tie
        for t, child in parent.children.items():
            p = prob * child.count / parent.cont
            if p >= min_prob:
                heapq.heappush(heap, (-p, tie, index, t, child))
                tie += 1

    push(node, -1, 1.0)
    while heap and len(tokens) < size:
        neg, _, parent, t, child = heapq.heappop(heap)
        tokens.append(t)
        parents.append(parent)
        probs.append(-neg)
        if child.cont:
            push(child, len(tokens) - 1, -neg)
    return Speculation(tuple(tokens), tuple(parents), tuple(probs), match_len)


def _size(node: TrieNode) -> int:
    """Nodes in the subtree of `node`, itself included."""
    total, stack = 0, [node]
    while stack:
        n = stack.pop()
        total += 1
        stack.extend(n.children.values())
    return total
