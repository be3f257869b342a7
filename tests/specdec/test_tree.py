"""Sparse trees: layout tables, greedy construction, the tree mask, and the three verifiers."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from runtime.loading import from_hf_state
from specdec.sampling import probs_from_logits
from specdec.tree import (Tree, build_tree, expected_length, normalize_paths, tree_mask,
                          tree_positions, tree_tokens, verify_greedy, verify_lossless, verify_typical)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return from_hf_state(AutoModelForCausalLM.from_config(cfg).state_dict(), cfg)


def test_paths_gain_missing_prefixes_and_sort():
    assert normalize_paths([(1, 0, 2), (0,)]) == ((0,), (1,), (1, 0), (1, 0, 2))
    with pytest.raises(ValueError, match="negative"):
        normalize_paths([(0, -1)])
    with pytest.raises(ValueError, match="non-empty"):
        normalize_paths([()])


def test_tree_tables():
    tree = Tree(((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)))
    assert tree.num_nodes == 7 and tree.max_depth == 3
    assert tree.parent == (-1, 0, 0, 1, 1, 2, 3)
    assert tree.depth == (0, 1, 1, 2, 2, 2, 3)
    assert tree.children[0] == (1, 2) and tree.children[1] == (3, 4) and tree.children[6] == ()
    assert tree.topk == (2, 2, 1)
    assert tree.path_to(6) == [1, 3, 6]
    anc = tree.ancestors()
    assert anc[6].nonzero().flatten().tolist() == [0, 1, 3, 6]


def test_build_tree_is_greedy_and_prefix_closed():
    acc = [[0.6, 0.2, 0.1], [0.4, 0.2, 0.1], [0.3, 0.1, 0.05]]
    paths = build_tree(acc, 5)
    assert paths == ((0,), (1,), (2,), (0, 0), (0, 1))
    assert normalize_paths(paths) == paths
    assert expected_length(paths, acc) == pytest.approx(0.6 + 0.2 + 0.1 + 0.24 + 0.12)
    assert expected_length(paths, acc) > expected_length(((0,), (0, 0), (0, 0, 0), (1,), (2,)), acc)
    assert build_tree([[1.0, 0.0]] * 3, 3) == ((0,), (0, 0), (0, 0, 0))


def test_tree_mask_matches_running_each_path_alone(model):
    tree = Tree(((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0)))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 128, (7,), generator=g), torch.randint(0, 128, (4,), generator=g)]
    tokens = torch.randint(0, 128, (2, tree.num_nodes), generator=g)  # (B, N)
    cache = model.new_cache(2, 32)
    lens = torch.tensor([7, 4])
    padded = torch.zeros(2, 7, dtype=torch.long)
    for b, p in enumerate(prompts):
        padded[b, :p.numel()] = p
    model(padded, torch.arange(7)[None].expand(2, -1), cache)
    cache.rollback(lens)
    mask = tree_mask(tree, lens, int(lens.max()) + tree.num_nodes)
    logits = model(tokens, tree_positions(tree, lens), cache, mask=mask)  # (B, N, V)
    for b in range(2):
        for leaf in (i for i in range(tree.num_nodes) if not tree.children[i]):
            path = [0] + tree.path_to(leaf)
            seq = torch.cat([prompts[b], tokens[b, path]])
            ref = model(seq[None], torch.arange(seq.numel())[None], None)[0, prompts[b].numel():]
            torch.testing.assert_close(logits[b, path], ref, rtol=1e-4, atol=1e-4)


def test_greedy_accepts_the_matching_branch():
    tree = Tree(((0,), (1,), (0, 0), (1, 0)))
    V = 10
    tokens = torch.tensor([[5, 1, 2, 7, 3]])  # root 5; children 1, 2; 1 -> 7, 2 -> 3
    logits = torch.zeros(1, 5, V)
    logits[0, 0, 2] = 5.0  # after the root the target wants 2 (node 2)
    logits[0, 2, 3] = 5.0  # after 2 it wants 3 (node 4)
    logits[0, 4, 9] = 5.0  # bonus
    logits[0, 1, 7] = 5.0  # the other branch would also match, but it is not on the path
    (v,) = verify_greedy(tree, tokens, logits)
    assert v.nodes == [2, 4] and v.tokens == [2, 3] and v.bonus == 9
    assert v.attempted == [1, 1] and v.accepted == [1, 1]
    logits[0, 0] = 0.0
    logits[0, 0, 8] = 5.0
    (v,) = verify_greedy(tree, tokens, logits)
    assert v.nodes == [] and v.bonus == 8 and v.attempted == [1, 0] and v.accepted == [0, 0]


def test_typical_acceptance_reduces_to_greedy_as_temperature_vanishes():
    tree = Tree(build_tree([[0.5, 0.3, 0.2], [0.5, 0.3, 0.2], [0.5, 0.3]], 12))
    g = torch.Generator().manual_seed(0)
    B, V = 64, 6
    guesses = [torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(B)]) for k in tree.topk]
    tokens = tree_tokens(tree, torch.randint(0, V, (B,), generator=g), guesses)  # siblings distinct
    logits = torch.randn(B, tree.num_nodes, V, generator=g) * 3
    greedy = verify_greedy(tree, tokens, logits)
    typical = verify_typical(tree, tokens, logits, 1e-4, 0, 1.0, 0.09, 0.3, g)
    assert [(v.nodes, v.bonus) for v in typical] == [(v.nodes, v.bonus) for v in greedy]
    assert sum(len(v.nodes) for v in greedy) > 0


def test_typical_threshold_is_min_of_epsilon_and_entropy_term():
    tree = Tree(((0,),))
    p = torch.tensor([0.5, 0.3, 0.2])
    logits = torch.log(p)[None, None].expand(1, 2, 3)
    entropy = float(-(p * p.log()).sum())
    tokens = torch.tensor([[0, 2]])  # the child proposes token 2, p = 0.2
    g = torch.Generator().manual_seed(0)
    # threshold = min(eps, delta * exp(-H)); exp(-H) ~ 0.36
    assert verify_typical(tree, tokens, logits, 1.0, 0, 1.0, 0.09, 0.3, g)[0].nodes == [1]
    assert verify_typical(tree, tokens, logits, 1.0, 0, 1.0, 0.25, 0.9, g)[0].nodes == []
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
    row = torch.tensor([4, 1, 3, 0, 2, 1])  # root, depth-1 guesses 1, 3, 0; under 1: 2, 1
    tokens = row[None].expand(n, -1)
    logits = node_logits[None].expand(n, -1, -1)
    verdicts = verify_lossless(tree, tokens, logits, 0.7, 0, 1.0, g)
    first = torch.tensor([(v.tokens + [v.bonus])[0] for v in verdicts])
    p_root = probs_from_logits(node_logits[0], 0.7)
    emp = torch.bincount(first, minlength=V).float() / n
    assert (emp - p_root).abs().max() < 0.02
    # the token after an accepted "1" (node 1) must follow the target's distribution at node 1
    second = torch.tensor([(v.tokens + [v.bonus])[1] for v in verdicts if v.tokens[:1] == [1]])
    p_node1 = probs_from_logits(node_logits[1], 0.7)
    emp2 = torch.bincount(second, minlength=V).float() / second.numel()
    assert second.numel() > 2000
    assert (emp2 - p_node1).abs().max() < 4 * (0.25 / second.numel()) ** 0.5 + 0.005
