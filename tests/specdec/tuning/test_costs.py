"""specdec.tuning.costs: block costs from timings, nodes valued by measured acceptance, and the cut
with the most expected tokens per second."""

import pytest

from specdec.tuning.costs import BlockCosts, NodeCalibration, batch_cut, best_cut


def _costs(table: dict[int, float]) -> BlockCosts:
    costs = BlockCosts()
    for block, seconds in table.items():
        costs.observe(block, seconds)
    return costs


def test_a_block_costs_the_median_of_its_timings_and_unmeasured_sizes_are_interpolated():
    costs = BlockCosts()
    assert not costs.known()
    with pytest.raises(ValueError, match="no verification"):
        costs.cost(1)
    for s in (0.05, 0.04, 0.30):  # one slow step does not move the median
        costs.observe(1, s)
    assert costs.cost(1) == pytest.approx(0.05) and not costs.known()
    costs.observe(4, 0.08)
    costs.observe(8, 0.12)
    assert costs.known()
    assert costs.cost(2) == pytest.approx(0.05 + 0.03 / 3)  # between 1 and 4
    assert costs.cost(6) == pytest.approx(0.10)  # between 4 and 8
    assert costs.cost(12) == pytest.approx(0.16)  # past 8: the line through 4 and 8


def test_a_timing_far_above_every_block_is_a_compile_and_is_ignored():
    costs = _costs({1: 0.05, 2: 0.06})
    costs.observe(4, 30.0)  # a program built on first use
    assert costs.sizes() == [1, 2] and costs.cost(4) == pytest.approx(0.08)  # the line through 1 and 2
    costs.observe(0, 0.05)
    costs.observe(3, 0.0)
    assert costs.sizes() == [1, 2]


def test_a_verification_told_by_two_observers_is_recorded_once():
    """The draft-length tuner and a drafter share a target's store: each verification (its number) counts
    once, whoever tells it first; verifications not numbered (0) always count."""
    costs = BlockCosts()
    for step, seconds in ((1, 0.05), (1, 0.05), (2, 0.07), (2, 0.07), (0, 0.04), (0, 0.04)):
        costs.observe(1, seconds, step)
    assert list(costs._times[1]) == [0.05, 0.07, 0.04, 0.04]


def test_the_cut_keeps_the_prefix_with_the_most_expected_tokens_per_second():
    costs = _costs({1: 1.0, 2: 1.0, 4: 1.5, 8: 2.0})
    # 1 node: 2/1.0; 2: 2.9/1.25 = 2.32; 3: 3.7/1.5 = 2.47; 4: 3.8/1.625 = 2.34
    assert best_cut([1.0, 0.9, 0.8, 0.1], costs) == 3
    assert best_cut([0.5, 0.2, 0.1], costs) == 1  # 1.5 / 1 beats 1.7 / 1.25 and 1.8 / 1.5
    assert best_cut([0.05, 0.05], _costs({1: 1.0, 2: 1.2, 3: 1.3})) == 0  # a plain step is faster
    assert best_cut([], costs) == 0
    assert best_cut([0.2] * 7, _costs({1: 1.0, 8: 1.0})) == 7  # rows cost nothing more: every node pays


def test_rows_verified_together_share_one_budget():
    """Four rows pay for the longest row's block: a tree that pays for one row alone does not pay
    when three rows with nothing to propose ride in the same block."""
    costs = _costs({1: 1.0, 2: 1.1, 3: 1.5, 4: 1.9})
    alone = [0.95, 0.9, 0.9]
    assert batch_cut([alone], costs) == best_cut(alone, costs) == 3  # 3.75 / 1.9 beats 2.85 / 1.5, 1.95 / 1.1
    assert batch_cut([alone, [], [], []], costs) == 1  # 4.95 / 1.1 beats 5.85 / 1.5, 6.75 / 1.9 and 4 / 1
    assert batch_cut([alone] * 4, costs) == 3
    assert batch_cut([[], []], costs) == 0 and batch_cut([], costs) == 0


def test_nodes_are_valued_at_the_acceptance_measured_for_their_probability():
    cal = NodeCalibration(bins=10)
    assert cal.value(0.95) == pytest.approx(0.95) and cal.value(0.41) == pytest.approx(0.45)  # bin midpoints
    for _ in range(300):  # paths of probability 1 accepted 3 times in 4, of 0.4 once in 6
        cal.observe([1.0, 1.0, 1.0, 1.0], [True, True, True, False])
        cal.observe([0.4] * 6, [True] + [False] * 5)
    assert cal.value(1.0) == pytest.approx(0.75, abs=0.01) and cal.value(0.42) == pytest.approx(1 / 6, abs=0.01)
    assert cal.value(0.7) == pytest.approx(0.75)  # a bin nothing fell in keeps its prior
