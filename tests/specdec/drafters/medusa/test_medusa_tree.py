"""Sparse trees: layout tables, greedy construction, the tree mask, and the heads' guesses laid
out as a DraftTree (verification: tests/specdec/test_verify.py)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from runtime.loading import from_hf_state
from specdec.drafters.medusa.tree import Tree, build_tree, draft_tree, expected_length, normalize_paths


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
    assert tree.topk == (2, 2, 1)
    parents, depths, anc = tree.layout  # as draft nodes: tree node i + 1 is draft node i
    assert parents.tolist() == [-1, -1, 0, 0, 1, 2] and depths.tolist() == [1, 1, 2, 2, 2, 3]
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
    parents, _, anc = tree.layout
    positions = lens[:, None] + torch.tensor(tree.depth)[None]  # (B, N)
    logits = model(tokens, positions, cache, block_mask=anc[None].expand(2, -1, -1)).logits  # (B, N, V)
    for b in range(2):
        for leaf in (i for i in range(len(parents)) if i not in parents.tolist()):
            path = anc[1 + leaf].nonzero().flatten().tolist()  # the root, then the nodes down to the leaf
            seq = torch.cat([prompts[b], tokens[b, path]])
            ref = model(seq[None], torch.arange(seq.numel())[None], None).logits[0, prompts[b].numel():]
            torch.testing.assert_close(logits[b, path], ref, rtol=1e-4, atol=1e-4)


def test_draft_tree_lays_guesses_out_in_node_order_with_the_tree_mask():
    tree = Tree(((0,), (1,), (0, 0), (1, 0), (0, 0, 0)))
    guesses = [torch.tensor([[10, 11], [20, 21]]), torch.tensor([[12], [22]]), torch.tensor([[13], [23]])]
    draft = draft_tree(tree, guesses, rows=[1])
    # nodes (0,), (1,), (0, 0), (1, 0), (0, 0, 0): head 0 ranks 0, 1; head 1 rank 0 twice; head 2
    assert draft.tokens.tolist() == [[10, 11, 12, 12, 13], [20, 21, 22, 22, 23]]
    assert draft.parents[0].tolist() == [-1, -1, 0, 1, 2] and draft.lens.tolist() == [0, 5]
    assert torch.equal(draft.block_mask()[1], tree.layout[2])
    assert draft.depths()[0].tolist() == list(tree.depth[1:])
