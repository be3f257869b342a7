"""`auto` for the EAGLE-3 tree on a tiny random target and head (float32): every size decodes the
same text, its tau is that text's, and auto picks the highest expected speed."""

import pytest
import torch

import specdec
from runtime.tiny import tiny_model
from specdec.drafters import EagleDrafter, EagleTreeConfig
from specdec.tuning.eagle_tree import auto_tree, describe, measure_eagle_trees
from specdec.tuning.tree_cost import decode_cost
from tests.specdec.drafters.eagle.test_eagle_drafter import prompts, random_head

V = 64


@pytest.fixture(scope="module")
def deep():
    return tiny_model("llama", seed=5, vocab_size=V, num_hidden_layers=6)


def test_auto_times_every_size_and_picks_the_highest_expected_speed(deep):
    head = random_head(deep)
    rows = prompts(2, seed=3, lo=4, hi=12)
    tree, record = auto_tree(deep, head, rows, depth=3, top_k=4, sizes=(2, 8, 64), tokens=10)
    assert [t["nodes"] for t in record["trees"]] == [2, 8]  # 64 exceeds the 36 candidates of 3 x 4
    best = max(record["trees"], key=lambda t: (t["expected_speedup"], -t["nodes"]))
    assert tree == EagleTreeConfig(3, 4, best["nodes"]) and record["chosen_nodes"] == tree.total_tokens
    for t in record["trees"]:
        assert t["step_ms"] > t["heads_ms"] > 0 and t["expected_tau"] >= 1
        assert t["expected_speedup"] == pytest.approx(t["expected_tau"] / t["vs_plain"])
    assert "chosen: " in describe(record)
    out = specdec.generate(deep, rows[:1], draft=EagleDrafter(head, deep, tree), max_new_tokens=12)
    assert torch.equal(out.sequences[0], specdec.generate(deep, rows[:1], max_new_tokens=12).sequences[0])


def test_each_size_is_warmed_up_before_it_is_timed(deep, monkeypatch):
    """On a compiled target a tree size's first steps build its programs: every size decodes untimed
    before its timed run (a few tokens eagerly, the whole run compiled), so no build counts as its
    step cost."""
    from specdec.tuning import eagle_tree, tree_cost

    calls = []

    def recording(model, rows, tokens, draft=None, num_draft_tokens=5):
        calls.append((None if draft is None else draft.tree.total_tokens, tokens))
        return decode_cost(model, rows, tokens, draft, num_draft_tokens)

    monkeypatch.setattr(eagle_tree, "decode_cost", recording)
    monkeypatch.setattr(tree_cost, "decode_cost", recording)  # the warm-ups (tree_cost.warm_up)
    head, rows = random_head(deep), prompts(1, seed=6)
    eagle_tree.measure_eagle_trees(deep, head, rows, sizes=(2, 8), depth=3, top_k=4, tokens=6)
    assert [c for c in calls if c[0] is not None] == [(2, 4), (2, 6), (8, 4), (8, 6)]
    # a compiled target (here its uncompiled static step: the same routing, no build) repeats the timed run untimed,
    # because which step shapes (chain or tree, padded size) a size meets depends on its drafts
    calls.clear()
    compiled = tiny_model("llama", seed=5, vocab_size=V, num_hidden_layers=6)
    compiled.compiled_step = compiled.static_step
    eagle_tree.measure_eagle_trees(compiled, head, rows, sizes=(2, 8), depth=3, top_k=4, tokens=6)
    assert [c for c in calls if c[0] is not None] == [(2, 6), (2, 6), (8, 6), (8, 6)]


def test_a_sizes_tau_is_measured_on_its_own_decoding(deep):
    """Tokens per step after the prefill, over every prompt, from each size's own run."""
    head = random_head(deep)
    rows = prompts(3, seed=5, lo=4, hi=14)
    taus = []
    for n in (2, 8, 48):
        drafter = EagleDrafter(head, deep, EagleTreeConfig(5, 8, n))
        step, in_head, tau = decode_cost(deep, rows, 16, drafter)
        stats = [specdec.generate(deep, [r], draft=drafter, max_new_tokens=16).stats for r in rows]
        assert tau == pytest.approx(sum(s.generated_tokens - 1 for s in stats) / sum(s.target_forwards - 1
                                                                                    for s in stats))
        assert step > in_head > 0
        taus.append(tau)
    assert min(taus) >= 1 and max(taus) > 1  # some drafts are accepted: the counts are not trivially 1


def test_bad_sizes_and_inputs_are_refused(deep):
    head = random_head(deep)
    rows = prompts(1, seed=4)
    with pytest.raises(ValueError, match="tree sizes"):
        measure_eagle_trees(deep, head, rows, sizes=(100,), depth=2, top_k=2)
    with pytest.raises(ValueError, match="tree sizes"):
        measure_eagle_trees(deep, head, rows, sizes=(0, 4))
    with pytest.raises(ValueError, match="tokens >= 2"):
        measure_eagle_trees(deep, head, rows, tokens=1)
