import pytest
import torch

import specdec
from runtime.loading import from_hf_state
from specdec.drafters.medusa.heads import MedusaConfig, MedusaHeads
from specdec.drafters.medusa.tree import Tree, build_tree
from specdec.tuning.medusa_replay import ReplayCounts, replay_row, replay_tau


@pytest.fixture(scope="module")
def model(tiny_llama):
    return from_hf_state(tiny_llama.state_dict(), tiny_llama.config)


def heads_for(model, seed):
    """Random (but not zero) residual blocks: guesses that are right only some of the time."""
    heads = MedusaHeads(MedusaConfig(64, 128, num_heads=3), model.lm_head)
    g = torch.Generator().manual_seed(seed)
    for blk in heads.blocks:
        blk[0].linear.weight.data = torch.randn(64, 64, generator=g) * 0.3
    return heads


def rows(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (int(torch.randint(3, 12, (), generator=g)),), generator=g) for _ in range(n)]


@pytest.mark.parametrize("nodes", [1, 4, 12])
def test_the_replay_equals_a_real_greedy_medusa_run_in_float32(model, nodes):
    heads = heads_for(model, seed=1)
    table = [[0.5, 0.2, 0.1, 0.05]] * 3
    tree = Tree(build_tree(table, nodes))
    heads.set_tree(tree.paths)
    prompts = rows(5)
    real = specdec.generate(model, prompts, draft=heads, max_new_tokens=30, eos_token_id=2).stats
    got = replay_tau(model, heads, prompts, {"t": tree}, max_new_tokens=30, eos_token_id=2)["t"]
    assert got.generated_tokens == real.generated_tokens
    assert got.target_forwards == real.target_forwards
    assert sum(got.accepted) == real.accepted_tokens > 0
    assert got.to_dict()["per_position_acceptance"][:tree.max_depth] == pytest.approx(
        real.per_position_acceptance[:tree.max_depth])
    assert got.tau == pytest.approx(real.mean_accepted_tokens)


def test_the_walk_takes_the_longest_path_the_tree_holds_and_stops_at_the_budget():
    tree = Tree(((0,), (1,), (0, 0), (1, 0)))
    # step 1 (row 0): head 0 rank 1, head 1 rank 0 -> path (1, 0), 2 accepted, next row 3;
    # step 2 (row 3): head 0 rank 2 -> nothing, next row 4; step 3 (row 4): 2 tokens are left, so
    # only depth 1 is verified: (0,) is accepted, its child is not tried, then the target's token
    ranks = torch.tensor([[1, 0], [0, 0], [0, 0], [2, 0], [0, 0], [0, 0], [0, 0]])
    counts = ReplayCounts()
    replay_row(tree, ranks, new_tokens=7, counts=counts)
    assert counts.target_forwards == 4  # the prefill and 3 steps
    assert counts.generated_tokens == 1 + 3 + 1 + 2
    assert counts.accepted == [2, 1] and counts.attempted == [3, 1]
    longer = ReplayCounts()  # the same tokens from a run allowed 9: step 3 verifies both depths
    replay_row(tree, ranks, new_tokens=7, counts=longer, max_new_tokens=9)
    assert longer.accepted == [2, 2] and longer.attempted == [3, 2]


def test_trees_deeper_than_the_heads_are_refused(model):
    heads = heads_for(model, seed=0)
    with pytest.raises(ValueError, match="only 3 heads"):
        replay_tau(model, heads, rows(1), {"deep": Tree(((0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)))}, 8)
