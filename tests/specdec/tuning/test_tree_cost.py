"""specdec.tuning.tree_cost: timing Medusa trees against plain steps and picking the size that pays."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import distill
from runtime.loading import from_hf_state
from specdec.drafters.medusa.tree import build_tree, expected_length
from specdec.tuning.tree_cost import TreeCost, best_tree, cost_report, describe, measure_trees

TABLE = [[0.6, 0.2, 0.1], [0.4, 0.15], [0.3]]  # accuracy[head][rank]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return from_hf_state(AutoModelForCausalLM.from_config(cfg).state_dict(), cfg)


def test_measure_trees_times_each_size_and_scores_it_from_the_accuracy_table(model):
    heads = distill.attach_medusa(model, num_heads=3)
    row = torch.arange(3, 11)
    plain, costs = measure_trees(model, heads, row, [1, 4], TABLE, tokens=6, repeats=1)
    assert plain > 0 and [c.nodes for c in costs] == [1, 4]
    for c in costs:
        tau = 1 + expected_length(build_tree(TABLE, c.nodes), TABLE)
        assert c.expected_tau == pytest.approx(tau)
        assert c.vs_plain == pytest.approx(c.step_s / plain)
        assert c.expected_speedup == pytest.approx(tau / c.vs_plain)
        assert 0 <= c.heads_s <= c.step_s
    assert len(heads.tree.paths) == 4  # left on the last size measured


def test_each_medusa_tree_is_warmed_up_before_it_is_timed(model, monkeypatch):
    """tree_cost.warm_up runs before each size's timing: a few tokens eagerly, the whole timed
    decoding on a compiled model (here its uncompiled static step: the same routing, no build), so a
    program build never counts as a tree's step cost, even with repeats=1."""
    from specdec.tuning import tree_cost

    calls = []
    original = tree_cost.decode_cost

    def recording(m, rows, tokens, draft=None, num_draft_tokens=5):
        calls.append((draft is not None, tokens))
        return original(m, rows, tokens, draft, num_draft_tokens)

    monkeypatch.setattr(tree_cost, "decode_cost", recording)
    heads = distill.attach_medusa(model, num_heads=3)
    measure_trees(model, heads, torch.arange(3, 11), [1, 4], TABLE, tokens=6, repeats=1)
    assert [c for c in calls if c[0]] == [(True, 4), (True, 6), (True, 4), (True, 6)]
    calls.clear()
    model.compiled_step = model.static_step
    try:
        measure_trees(model, heads, torch.arange(3, 11), [1, 4], TABLE, tokens=6, repeats=1)
    finally:
        model.compiled_step = None
    assert [c for c in calls if c[0]] == [(True, 6), (True, 6), (True, 6), (True, 6)]


def test_measure_trees_rejects_impossible_sizes(model):
    heads = distill.attach_medusa(model, num_heads=3)
    with pytest.raises(ValueError, match="tree sizes must be >= 1"):
        measure_trees(model, heads, torch.arange(3, 8), [0, 4], TABLE)
    with pytest.raises(ValueError, match="tokens >= 2"):
        measure_trees(model, heads, torch.arange(3, 8), [4], TABLE, tokens=1)


def cost(nodes, speedup):
    return TreeCost(nodes=nodes, step_s=0.1, heads_s=0.0, vs_plain=1.0, expected_tau=speedup,
                    expected_speedup=speedup)


def test_best_tree_takes_the_highest_expected_speed_and_the_smaller_tree_on_a_tie():
    assert best_tree([cost(1, 1.4), cost(4, 1.6), cost(24, 1.1)]).nodes == 4
    assert best_tree([cost(8, 1.5), cost(4, 1.5)]).nodes == 4
    with pytest.raises(ValueError, match="no tree sizes"):
        best_tree([])


def test_cost_report_and_describe_record_every_size_and_the_chosen_one():
    costs = [cost(1, 1.4), cost(4, 1.6), cost(24, 1.1)]
    report = cost_report(0.2, costs)
    assert report["chosen_nodes"] == 4 and report["plain_step_ms"] == pytest.approx(200.0)
    assert [t["nodes"] for t in report["trees"]] == [1, 4, 24]
    lines = describe(0.2, costs).splitlines()
    assert lines[0] == "plain step 200 ms" and len(lines) == 4 and "expected speed 1.60x" in lines[2]
