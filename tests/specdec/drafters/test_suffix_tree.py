"""The bounded-depth suffix trie against a brute-force matcher: continuation counts after every
pattern, after appends in chunks and after removals, and the best-first speculation tree."""

import random

import pytest

from specdec.drafters.suffix_tree import SuffixTrie


def brute_continuations(seqs: list[list[int]], pattern: list[int], depth: int) -> dict[int, int]:
    """Next token -> occurrences of pattern + token in `seqs`, for patterns of < depth tokens."""
    out: dict[int, int] = {}
    m = len(pattern)
    if m >= depth:
        return out
    for s in seqs:
        for j in range(len(s) - m):
            if s[j:j + m] == pattern:
                out[s[j + m]] = out.get(s[j + m], 0) + 1
    return out


def _random_seqs(rng: random.Random, n: int, alphabet: int = 4) -> list[list[int]]:
    return [[rng.randrange(alphabet) for _ in range(rng.randrange(1, 40))] for _ in range(n)]


def _all_patterns(seqs: list[list[int]], longest: int) -> set[tuple[int, ...]]:
    return {tuple(s[j:j + m]) for s in seqs for m in range(longest + 1) for j in range(len(s) - m + 1)}


@pytest.mark.parametrize("depth", [2, 3, 6])
def test_continuations_equal_the_brute_force_count_for_every_pattern(depth):
    rng = random.Random(depth)
    seqs = _random_seqs(rng, 6)
    trie = SuffixTrie(depth)
    for s in seqs:  # each sequence appended in random chunks
        windows, i = [], 0
        while i < len(s):
            j = i + rng.randrange(1, 5)
            windows = trie.extend(windows, s[i:j])
            i = j
    for pattern in _all_patterns(seqs, depth) | {(9,), (0, 9)}:
        assert trie.continuations(list(pattern)) == brute_continuations(seqs, list(pattern), depth), pattern


def test_removing_sequences_leaves_the_counts_of_the_others_and_frees_their_nodes():
    rng = random.Random(7)
    seqs = _random_seqs(rng, 8)
    trie = SuffixTrie(5)
    empty_nodes = trie.nodes
    for s in seqs:
        trie.extend([], s)
    for gone in (3, 0, 6):
        trie.remove(seqs[gone])
    kept = [s for i, s in enumerate(seqs) if i not in (3, 0, 6)]
    for pattern in _all_patterns(seqs, 5):
        assert trie.continuations(list(pattern)) == brute_continuations(kept, list(pattern), 5)
    fresh = SuffixTrie(5)
    for s in kept:
        fresh.extend([], s)
    assert trie.nodes == fresh.nodes  # no node is left behind
    for s in kept:
        trie.remove(s)
    assert trie.nodes == empty_nodes and trie.root.cont == 0 and not trie.root.children


def test_speculation_follows_the_most_frequent_continuation_of_the_longest_useful_match():
    trie = SuffixTrie(8)
    trie.extend([], [1, 2, 3, 4, 5, 9, 1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 7])
    spec = trie.speculate([6, 1, 2, 3], max_nodes=6, max_factor=2.0, min_prob=0.0)
    # after "1 2 3": "4 5 9 1 2" twice (the trie holds 8-token paths), "7 7" once; best first
    assert spec.match_len == 3
    assert spec.tokens == (4, 5, 9, 1, 2, 7) and spec.parents == (-1, 0, 1, 2, 3, -1)
    assert spec.probs == pytest.approx([2 / 3] * 5 + [1 / 3])
    assert spec.score == pytest.approx(sum(spec.probs))


def test_speculation_tree_probabilities_are_the_brute_force_path_frequencies():
    rng = random.Random(3)
    seqs = _random_seqs(rng, 10, alphabet=3)
    depth = 6
    trie = SuffixTrie(depth)
    for s in seqs:
        trie.extend([], s)
    for context in ([0, 1], [2, 2, 1], [1]):
        spec = trie.speculate(context, max_nodes=6, max_factor=3.0, min_prob=0.0)
        m = spec.match_len
        assert m >= 1 and spec.tokens
        for i, (t, prob) in enumerate(zip(spec.tokens, spec.probs)):
            path = [i]
            while spec.parents[path[-1]] >= 0:
                path.append(spec.parents[path[-1]])
            tokens = [spec.tokens[j] for j in reversed(path)]
            want, pattern = 1.0, list(context[len(context) - m:])
            for tok in tokens:  # product of conditional frequencies along the path
                cont = brute_continuations(seqs, pattern, depth)
                want *= cont[tok] / sum(cont.values())
                pattern.append(tok)
            assert prob == pytest.approx(want)
        assert list(spec.probs) == sorted(spec.probs, reverse=True)  # best first, parents before children


def test_speculation_size_follows_the_match_and_drops_unlikely_nodes():
    trie = SuffixTrie(12)
    trie.extend([], list(range(10)) * 3)
    assert len(trie.speculate([0, 1], max_nodes=16, max_factor=1.0).tokens) == 2  # 2 matched tokens, factor 1
    assert len(trie.speculate([0, 1], max_nodes=3, max_factor=4.0).tokens) == 3  # max_nodes bounds it
    assert trie.speculate([42], max_nodes=4).tokens == ()  # never seen
    trie.extend([], [50, 1, 50, 2, 50, 3, 50, 4, 50, 5, 50, 6, 50, 7, 50, 8, 50, 9, 50, 10, 50])
    # after "50" each of 10 tokens follows once: every node is below min_prob 0.2
    assert trie.speculate([50], max_nodes=4, min_prob=0.2).tokens == ()


def test_a_depth_below_two_is_refused():
    with pytest.raises(ValueError, match="depth"):
        SuffixTrie(1)
