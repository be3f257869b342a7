"""specdec.autok: the online draft-length choice maximises modelled tokens per second."""

import pytest

from specdec.autok import AutoK


def _trained(alpha_steps: int = 200, accepted: int = 9, drafted: int = 10) -> AutoK:
    """An AutoK that saw `accepted` of `drafted` drafts per step and a target cost of
    0.1 s + 0.01 s per block token."""
    auto = AutoK(k_max=16)
    for i in range(alpha_steps):
        block = 2 + i % 8
        auto.observe(accepted, drafted, block, 0.1 + 0.01 * block)
    return auto


def test_target_cost_is_the_fitted_line():
    auto = _trained()
    assert auto.target_cost(4) == pytest.approx(0.14, rel=1e-6)
    assert auto.target_cost(12) == pytest.approx(0.22, rel=1e-6)


def test_alpha_is_accepted_over_reached():
    auto = _trained(accepted=3, drafted=10)  # each step: 3 accepted, the 4th reached and rejected
    assert auto.alpha() == pytest.approx(3 / 4, rel=1e-3)


@pytest.mark.parametrize("first,step", [(0.0, 0.0), (0.05, 0.01), (0.05, 0.05), (0.2, 0.002)])
def test_choice_is_the_best_k_of_the_model(first, step):
    auto = _trained()
    a = auto.alpha()

    def cost(k):
        return first + (k - 1) * step

    def rate(k):
        return (1 - a ** (k + 1)) / (1 - a) / (cost(k) + auto.target_cost(k + 1))

    assert auto.choose(cost) == max(range(1, 17), key=rate)


def test_expensive_drafts_shorten_and_free_drafts_lengthen_k():
    auto = _trained()
    assert auto.choose(lambda k: 0.5 * k) < auto.choose(lambda k: 0.01 * k)
    flat = AutoK(k_max=16)  # every block costs the same (a compiled target's padded blocks)
    for _ in range(50):
        flat.observe(9, 10, 8, 0.2)
    assert flat.choose(lambda k: 0.0) == 16
