"""specdec.tuning.autok: the online draft-length choice maximises modelled tokens per second."""

import gc
import math
import weakref

import pytest
import torch

from runtime.tiny import tiny_model
from specdec.tuning.autok import AutoK
from specdec.tuning.costs import BlockCosts, target_costs


def _trained(alpha_steps: int = 200, accepted: int = 9, drafted: int = 10) -> AutoK:
    """An AutoK that saw `accepted` of `drafted` drafts per step and a target cost of
    0.1 s + 0.01 s per block token (blocks of 2..9 tokens)."""
    auto = AutoK(k_max=16)
    for i in range(alpha_steps):
        block = 2 + i % 8
        auto.observe(accepted, drafted)
        auto.time_block(block, 0.1 + 0.01 * block)
    return auto


def test_target_cost_is_measured_per_size_and_extended_by_the_last_two():
    auto = _trained()
    assert auto.target_cost(4) == pytest.approx(0.14, rel=1e-6)
    assert auto.target_cost(12) == pytest.approx(0.22, rel=1e-6)


def test_padded_blocks_cost_their_padded_size():
    """A compiled 4-bit target pads blocks of 5..8 tokens to 8, which costs twice a block of 4: a
    line through the sizes 2 and 4 would call a 5-token block cheap, the padded size does not."""
    auto = AutoK(k_max=7, costs=BlockCosts(padded=lambda block: 2 if block <= 2 else 4 if block <= 4 else 8))
    for _ in range(8):
        auto.observe(6, 7)
        for block, seconds in ((2, 0.10), (4, 0.12), (8, 0.24)):
            auto.time_block(block, seconds)
    assert auto.target_cost(3) == auto.target_cost(4) == pytest.approx(0.12)
    assert auto.target_cost(5) == auto.target_cost(8) == pytest.approx(0.24)
    auto.time_block(6, 0.9)  # a slow first call of a program is outvoted by its padded size's samples
    assert auto.target_cost(6) == auto.target_cost(5) == pytest.approx(0.24)
    assert auto.costs.sizes() == [2, 4, 8]
    # drafts cost 0.01 s each and are accepted at ~0.85: 3 drafts (a 4-token block) beat 4 (padded to 8)
    assert auto.choose(lambda k: 0.01 * k) == 3


def test_first_steps_time_the_smallest_block_then_try_larger_ones():
    auto = AutoK(k_max=7)
    assert auto.target_cost(2) is None
    assert auto.choose(lambda k: 0.0) == 1  # nothing timed: the smallest block first
    auto.observe(1, 1)
    auto.time_block(2, 0.1)
    assert auto.choose(lambda k: 0.0) == 7  # larger sizes cost what the one timed did until timed


def test_costs_are_shared_through_the_store_and_compiles_are_dropped():
    shared = BlockCosts()
    first, second = AutoK(costs=shared), AutoK(costs=shared)
    first.time_block(4, 9.0)  # a first step that compiled its program
    first.time_block(4, 0.1)
    first.time_block(2, 0.08)
    assert second.target_cost(4) == pytest.approx(0.1)  # the compile was dropped once a step came
    assert second.choose(lambda k: 0.0) >= 1 and shared.sizes() == [2, 4]


def test_target_costs_is_one_store_per_target_and_batch_size_padded_as_it_runs():
    target, other = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    assert target_costs(target, 1) is target_costs(target, 1)
    assert target_costs(target, 1) is not target_costs(target, 2)
    assert target_costs(target, 1) is not target_costs(other, 1)
    assert target_costs(target, 1).padded is None  # not a runtime model: sizes as they are
    model = tiny_model("qwen2", dtype=torch.bfloat16)
    assert target_costs(model, 1).padded(5) == 5  # eager: no padding
    model.compile_decode()
    assert target_costs(model, 3).padded(5) == model.verify_tokens(5, 3) == 8
    held = weakref.ref(model)
    del model
    gc.collect()
    assert held() is None  # the store holds its targets weakly


def test_alpha_is_accepted_over_reached():
    auto = _trained(accepted=3, drafted=10)  # each step: 3 accepted, the 4th reached and rejected
    assert auto.alpha() == pytest.approx(3 / 4, rel=1e-3)


@pytest.mark.parametrize("first,step", [(0.0, 0.0), (0.05, 0.01), (0.05, 0.05), (0.2, 0.002)])
def test_choice_is_the_best_k_of_the_model(first, step):
    auto = _trained(accepted=5, drafted=8)
    a = auto.acceptance()

    def cost(k):
        return first + (k - 1) * step

    def rate(k):
        tokens = 1 + sum(math.prod(a[:j]) for j in range(1, k + 1))
        return tokens / (cost(k) + auto.target_cost(k + 1))

    assert auto.choose(cost) == max(range(1, 17), key=rate)


def test_geometric_runs_give_the_closed_form():
    """Run lengths drawn with one acceptance rate: every position estimates that rate, and the
    expected tokens are (1 - alpha^(k+1)) / (1 - alpha)."""
    gen = torch.Generator().manual_seed(0)
    auto = AutoK(k_max=8, decay=0.999)
    for _ in range(4000):
        accepted = 0
        while accepted < 8 and torch.rand((), generator=gen) < 0.7:
            accepted += 1
        auto.observe(accepted, 8)
        auto.time_block(9, 0.1)
    for a in auto.acceptance()[:6]:
        assert a == pytest.approx(0.7, abs=0.03)
    tokens = auto.expected_tokens()
    for k in (1, 3, 5):
        assert tokens[k] == pytest.approx((1 - 0.7 ** (k + 1)) / 0.3, rel=0.05)


def test_acceptance_rising_with_position_lengthens_k():
    """Half the steps miss the first draft, the rest accept all 8: position 1 runs at 0.5 and
    the later ones near 1 (shrunk a little towards position 1). The pooled rate (8/12) would pick
    a short k; per position, k = 8."""
    auto = AutoK(k_max=8)
    for i in range(200):
        auto.observe(0 if i % 2 else 8, 8)
        auto.time_block(2 + i % 8, 0.1 + 0.01 * (i % 8))
    a = auto.acceptance()
    assert a[0] == pytest.approx(0.5, abs=0.05) and min(a[1:]) > 0.9
    step_cost = 0.02  # each draft costs a fifth of a target pass

    def geometric_best(alpha):
        return max(range(1, 9), key=lambda k: (1 - alpha ** (k + 1)) / (1 - alpha)
                   / (k * step_cost + auto.target_cost(k + 1)))

    assert geometric_best(auto.alpha()) < 8
    assert auto.choose(lambda k: k * step_cost) == 8


def test_positions_never_reached_take_the_rate_of_the_one_before():
    auto = AutoK(k_max=8)
    for _ in range(100):
        auto.observe(2, 3)  # positions 1-2 accepted, 3 rejected, 4.. never verified
    a = auto.acceptance()
    assert a[0] > 0.95 and a[2] < 0.15
    assert a[3:] == pytest.approx([a[2]] * 5, abs=1e-9)


def test_expensive_drafts_shorten_and_free_drafts_lengthen_k():
    auto = _trained()
    assert auto.choose(lambda k: 0.5 * k) < auto.choose(lambda k: 0.01 * k)
    flat = AutoK(k_max=16)  # every block costs the same (a compiled target's padded blocks)
    for _ in range(50):
        flat.observe(9, 10)
        flat.time_block(8, 0.2)
    assert flat.choose(lambda k: 0.0) == 16
