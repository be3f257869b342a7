"""Verification: greedy picks the target's path through a tree, typical acceptance's threshold,
and lossless rejection sampling (chains and trees, one-hot and sampled drafts) keeps the
target's distribution."""

import pytest
import torch

from specdec.drafter import DraftTree, TypicalAcceptance
from specdec.drafters.medusa.tree import Tree, build_tree, draft_tree
from specdec.sampling import probs_from_logits
from specdec.verify import verify


def _tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * (a - b).abs().sum().item()


def _all(tree: DraftTree) -> torch.Tensor:
    return torch.arange(tree.num_nodes)[None] < tree.lens[:, None]


def _medusa_tree(tree: Tree, row: list[int], n: int = 1) -> DraftTree:
    """The DraftTree of a Medusa `tree` whose nodes (root excluded) hold the tokens `row`."""
    nodes = torch.tensor(row)[None].expand(n, -1)
    return DraftTree(nodes.clone(), (torch.tensor(tree.parent[1:]) - 1)[None].expand(n, -1).contiguous(),
                     torch.full((n,), len(row), dtype=torch.long))


@pytest.mark.parametrize("one_hot_draft", [False, True])
def test_chain_rejection_sampler_reproduces_the_target_distribution(one_hot_draft):
    """N = 200k draws over 8 tokens; the sampling noise of the TV distance is ~0.002, the bound
    0.01, while the draft's own law is 0.4+ away from the target's, so a wrong sampler fails."""
    g = torch.Generator().manual_seed(0)
    n, vocab = 200_000, 8
    p_logits = torch.tensor([2.0, 1.5, 0.2, -1.0, 0.0, 0.7, -2.0, 1.0])
    q_probs = torch.tensor([0.02, 0.05, 0.4, 0.3, 0.1, 0.05, 0.05, 0.03])
    p = p_logits.softmax(-1)
    drafts = torch.multinomial(q_probs, n, replacement=True, generator=g)[:, None]  # (N, 1)
    q = None if one_hot_draft else q_probs.expand(n, 1, vocab)
    tree = DraftTree.chain(drafts, torch.ones(n, dtype=torch.long), q)
    verdict = verify(p_logits.expand(n, 2, vocab), tree, _all(tree), 1.0, generator=g)
    accepted = torch.tensor([len(path) for path in verdict.paths])
    first = torch.where(accepted > 0, drafts[:, 0], verdict.next_tokens)
    freq = torch.bincount(first, minlength=vocab).float() / n
    assert _tv(q_probs, p) > 0.4
    assert _tv(freq, p) < 0.01


def test_greedy_accepts_the_matching_branch():
    tree = Tree(((0,), (1,), (0, 0), (1, 0)))
    V = 10
    draft = _medusa_tree(tree, [1, 2, 7, 3])  # children of the root 1, 2; 1 -> 7, 2 -> 3
    logits = torch.zeros(1, 5, V)
    logits[0, 0, 2] = 5.0  # after the root the target wants 2 (draft node 1)
    logits[0, 2, 3] = 5.0  # after 2 it wants 3 (draft node 3)
    logits[0, 4, 9] = 5.0  # next token
    logits[0, 1, 7] = 5.0  # the other branch would also match, but it is not on the path
    v = verify(logits, draft, _all(draft), 0.0)
    assert v.paths == [[1, 3]] and v.next_tokens.tolist() == [9]
    logits[0, 0] = 0.0
    logits[0, 0, 8] = 5.0
    v = verify(logits, draft, _all(draft), 0.0)
    assert v.paths == [[]] and v.next_tokens.tolist() == [8]


def test_greedy_ignores_nodes_that_are_not_valid():
    tree = Tree(((0,), (0, 0)))
    draft = _medusa_tree(tree, [4, 5])
    logits = torch.zeros(1, 3, 8)
    logits[0, 0, 4], logits[0, 1, 5], logits[0, 2, 6] = 5.0, 5.0, 5.0
    assert verify(logits, draft, torch.tensor([[True, True]]), 0.0).paths == [[0, 1]]
    v = verify(logits, draft, torch.tensor([[True, False]]), 0.0)  # depth 2 past the row's budget
    assert v.paths == [[0]] and v.next_tokens.tolist() == [5]


def test_greedy_on_a_chain_equals_greedy_on_the_same_tree():
    g = torch.Generator().manual_seed(3)
    B, k, V = 16, 5, 6
    tokens = torch.randint(0, V, (B, k), generator=g)
    lens = torch.randint(0, k + 1, (B,), generator=g)
    logits = torch.randn(B, k + 1, V, generator=g)
    logits.scatter_(2, torch.cat([tokens, tokens[:, :1]], 1)[:, :, None], 9.0)  # mostly accepted
    logits[:, 2] = torch.randn(B, V, generator=g)  # ... but not always past the second draft
    chain = DraftTree.chain(tokens, lens)
    as_tree = DraftTree(tokens, chain.parents.clone(), lens)
    as_tree._cache["chain"] = False  # force the tree path
    a, b = verify(logits, chain, _all(chain), 0.0), verify(logits, as_tree, _all(as_tree), 0.0)
    assert a.paths == b.paths and torch.equal(a.next_tokens, b.next_tokens)
    assert any(len(p) > 1 for p in a.paths)


def test_typical_acceptance_reduces_to_greedy_as_temperature_vanishes():
    tree = Tree(build_tree([[0.5, 0.3, 0.2], [0.5, 0.3, 0.2], [0.5, 0.3]], 12))
    g = torch.Generator().manual_seed(0)
    B, V = 64, 6
    guesses = [torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(B)]) for k in tree.topk]
    draft = draft_tree(tree, guesses)  # siblings distinct
    logits = torch.randn(B, tree.num_nodes, V, generator=g) * 3
    greedy = verify(logits, draft, _all(draft), 0.0)
    typical = verify(logits, draft, _all(draft), 1e-4, generator=g, typical=TypicalAcceptance(0.09, 0.3))
    assert typical.paths == greedy.paths and torch.equal(typical.next_tokens, greedy.next_tokens)
    assert sum(len(p) for p in greedy.paths) > 0


def test_typical_threshold_is_min_of_epsilon_and_entropy_term():
    tree = Tree(((0,),))
    p = torch.tensor([0.5, 0.3, 0.2])
    logits = torch.log(p)[None, None].expand(1, 2, 3)
    entropy = float(-(p * p.log()).sum())
    draft = _medusa_tree(tree, [2])  # the child proposes token 2, p = 0.2
    g = torch.Generator().manual_seed(0)
    # threshold = min(eps, delta * exp(-H)); exp(-H) ~ 0.36
    assert verify(logits, draft, _all(draft), 1.0, generator=g, typical=TypicalAcceptance(0.09, 0.3)).paths == [[0]]
    assert verify(logits, draft, _all(draft), 1.0, generator=g, typical=TypicalAcceptance(0.25, 0.9)).paths == [[]]
    assert 0.9 * torch.exp(torch.tensor(-entropy)) > 0.25


def test_lossless_tree_sampler_reproduces_the_target_distribution():
    """Recursive rejection over siblings emits tokens distributed exactly as the target.

    Vocabulary 5, a tree whose children include likely and unlikely tokens. With n = 20000 draws
    each empirical probability has a standard deviation <= sqrt(0.25 / n) = 0.0035; the bound
    0.02 is > 5 standard deviations, so the test fails only for a biased sampler.
    """
    tree = Tree(((0,), (1,), (2,), (0, 0), (0, 1)))
    V, n = 5, 20000
    g = torch.Generator().manual_seed(0)
    node_logits = torch.randn(tree.num_nodes, V, generator=g) * 1.5
    node_logits[0, 1] += 2.0  # make the first child likely enough to study what follows it
    draft = _medusa_tree(tree, [1, 3, 0, 2, 1], n)  # depth-1 guesses 1, 3, 0; under 1: 2, 1
    verdict = verify(node_logits[None].expand(n, -1, -1), draft, _all(draft), 0.7, generator=g)
    emitted = [draft.tokens[0, path].tolist() + [int(t)] for path, t in zip(verdict.paths, verdict.next_tokens)]
    first = torch.tensor([e[0] for e in emitted])
    p_root = probs_from_logits(node_logits[0], 0.7)
    emp = torch.bincount(first, minlength=V).float() / n
    assert (emp - p_root).abs().max() < 0.02
    # the token after an accepted "1" (draft node 0) must follow the target's distribution there
    second = torch.tensor([e[1] for e, path in zip(emitted, verdict.paths) if path[:1] == [0]])
    p_node = probs_from_logits(node_logits[1], 0.7)
    emp2 = torch.bincount(second, minlength=V).float() / second.numel()
    assert second.numel() > 2000
    assert (emp2 - p_node).abs().max() < 4 * (0.25 / second.numel()) ** 0.5 + 0.005


def test_lossless_tree_with_sampled_siblings_reproduces_the_target_distribution():
    """Three siblings drawn independently from a draft law q far from the target's p: the first
    emitted token still follows p (n = 20000, same bound as above)."""
    V, n = 6, 20000
    g = torch.Generator().manual_seed(1)
    p_logits = torch.tensor([1.5, 0.2, -0.5, 1.0, 0.0, -1.0])
    q_probs = torch.tensor([0.05, 0.4, 0.3, 0.05, 0.1, 0.1])
    drafts = torch.multinomial(q_probs, 3 * n, replacement=True, generator=g).view(n, 3)  # (n, 3)
    tree = DraftTree(drafts, torch.full((n, 3), -1), torch.full((n,), 3), q_probs.expand(n, 3, V))
    verdict = verify(p_logits.expand(n, 4, V), tree, _all(tree), 1.0, generator=g)
    first = torch.tensor([int(drafts[b, path[0]]) if path else int(t)
                          for b, (path, t) in enumerate(zip(verdict.paths, verdict.next_tokens))])
    emp = torch.bincount(first, minlength=V).float() / n
    assert _tv(q_probs, p_logits.softmax(-1)) > 0.3
    assert (emp - p_logits.softmax(-1)).abs().max() < 0.02


def test_typical_acceptance_takes_the_deepest_passing_branch():
    """Medusa's reference keeps the longest passing candidate: here the first child passes but ends
    there, while its sibling passes and so does that sibling's child."""
    tree = Tree(((0,), (1,), (1, 0)))
    V = 6
    draft = _medusa_tree(tree, [1, 2, 3])  # children of the root 1, 2; 2 -> 3
    logits = torch.full((1, 4, V), -9.0)
    logits[0, 0, 1], logits[0, 0, 2] = 2.0, 2.0  # after the root tokens 1 and 2 both pass
    logits[0, 2, 3] = 9.0  # after 2, token 3 passes
    logits[0, 3, 5] = 9.0  # after 3 the target puts its mass on 5
    g = torch.Generator().manual_seed(0)
    v = verify(logits, draft, _all(draft), 1.0, generator=g, typical=TypicalAcceptance(0.09, 0.3))
    assert v.paths == [[1, 2]] and v.next_tokens.tolist() == [5]
    v = verify(logits, draft, torch.tensor([[True, True, False]]), 1.0, generator=g,
               typical=TypicalAcceptance(0.09, 0.3))  # the deep node past the row's budget
    assert v.paths == [[0]]  # both depth-1 nodes pass: the first (best-ranked) one
