"""`auto` for the EAGLE-3 tree on a tiny random target and head (float32): a tree of N nodes is the
first N nodes of a larger one (what makes the replay exact for one step), and auto times every
size and picks the highest expected speed."""

import pytest
import torch

import specdec
from runtime.tiny import tiny_model
from specdec.drafters import EagleDrafter, EagleTreeConfig
from specdec.eagle_auto import _Recording, auto_tree, describe, measure_eagle_trees, replay_tau
from tests.specdec.drafters.test_eagle_drafter import prompts, random_head

V = 64


@pytest.fixture(scope="module")
def deep():
    return tiny_model("llama", seed=5, vocab_size=V, num_hidden_layers=6)


class _FirstTree(_Recording):
    """Keeps the first proposed tree as well as the accepted paths."""

    def propose(self, seqs, k, rows):
        tree = super().propose(seqs, k, rows)
        if not hasattr(self, "first"):
            self.first = (tree.tokens.clone(), tree.parents.clone())
        return tree


def test_a_smaller_tree_is_the_first_nodes_of_a_larger_one_and_replays_its_first_step(deep):
    head = random_head(deep)
    accepted = 0
    for row in prompts(4, seed=1, lo=3, hi=20):
        runs = {}
        for n in (2, 8, 24, 48):
            rec = _FirstTree(head, deep, EagleTreeConfig(5, 8, n))
            specdec.generate(deep, [row], draft=rec, max_new_tokens=16)
            runs[n] = rec
        tokens, parents = runs[48].first
        for n in (2, 8, 24):
            assert torch.equal(runs[n].first[0], tokens[:, :n]) and torch.equal(runs[n].first[1], parents[:, :n])
            assert runs[n].paths[0] == [i for i in runs[48].paths[0] if i < n]
        accepted += len(runs[48].paths[0])
    assert accepted > 0  # the comparison is not of empty paths only


def test_replay_counts_the_accepted_nodes_below_each_size():
    paths = [[0, 5], [3], [], [1, 2, 9]]
    assert replay_tau(paths, 1) == 1 + 1 / 4
    assert replay_tau(paths, 4) == 1 + 4 / 4
    assert replay_tau(paths, 10) == 1 + 6 / 4
    with pytest.raises(ValueError, match="no verification steps"):
        replay_tau([], 4)


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


def test_bad_sizes_and_inputs_are_refused(deep):
    head = random_head(deep)
    rows = prompts(1, seed=4)
    with pytest.raises(ValueError, match="tree sizes"):
        measure_eagle_trees(deep, head, rows, sizes=(100,), depth=2, top_k=2)
    with pytest.raises(ValueError, match="tree sizes"):
        measure_eagle_trees(deep, head, rows, sizes=(0, 4))
    with pytest.raises(ValueError, match="tokens >= 2"):
        measure_eagle_trees(deep, head, rows, tokens=1)
