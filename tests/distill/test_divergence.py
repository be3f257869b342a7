"""The four DistillSpec divergences against values worked out by hand on two-token distributions."""

from __future__ import annotations

import math

import pytest
import torch

from distill.divergence import DIVERGENCES, masked_divergence, token_divergence

# teacher p = (1/2, 1/2), student q = (3/4, 1/4)
P, Q = (0.5, 0.5), (0.75, 0.25)
FKL = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)  # 0.14384
RKL = 0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5)  # 0.13081
M = (0.625, 0.375)  # beta p + (1 - beta) q at beta = 1/2
JSD = 0.5 * (0.5 * math.log(0.5 / M[0]) + 0.5 * math.log(0.5 / M[1])) \
    + 0.5 * (0.75 * math.log(0.75 / M[0]) + 0.25 * math.log(0.25 / M[1]))  # 0.03382
TVD = 0.5 * (abs(0.5 - 0.75) + abs(0.5 - 0.25))  # 0.25


def _logits(probs: tuple[float, ...]) -> torch.Tensor:
    return torch.tensor(probs).log()[None] + 3.0  # (1, V); a shift must not matter


@pytest.mark.parametrize("kind,expected", [("fkl", FKL), ("rkl", RKL), ("jsd", JSD), ("tvd", TVD)])
def test_each_divergence_equals_the_hand_value(kind, expected):
    got = token_divergence(_logits(Q), _logits(P), kind, temperature=1.0, beta=0.5)
    assert got.shape == (1,)
    assert float(got) == pytest.approx(expected, rel=1e-5)


def test_jsd_with_beta_a_quarter():
    beta = 0.25
    m = [beta * p + (1 - beta) * q for p, q in zip(P, Q)]
    expected = beta * sum(p * math.log(p / mi) for p, mi in zip(P, m)) \
        + (1 - beta) * sum(q * math.log(q / mi) for q, mi in zip(Q, m))
    assert float(token_divergence(_logits(Q), _logits(P), "jsd", beta=beta)) == pytest.approx(expected, rel=1e-5)


def test_jsd_ends_are_the_two_kls():
    q, p = _logits(Q), _logits(P)
    assert float(token_divergence(q, p, "jsd", beta=0.0)) == pytest.approx(FKL, rel=1e-5)
    assert float(token_divergence(q, p, "jsd", beta=1.0)) == pytest.approx(RKL, rel=1e-5)


def test_temperature_flattens_both_distributions():
    # at tau = 2, softmax(log q / 2) is proportional to sqrt(q); p stays uniform
    s = [math.sqrt(x) for x in Q]
    q2 = [x / sum(s) for x in s]
    expected = 0.5 * (abs(0.5 - q2[0]) + abs(0.5 - q2[1]))
    assert float(token_divergence(_logits(Q), _logits(P), "tvd", temperature=2.0)) == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("kind", DIVERGENCES)
def test_zero_for_equal_distributions_and_positive_otherwise(kind):
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(5, 11, generator=gen), torch.randn(5, 11, generator=gen)
    assert token_divergence(a, a, kind).abs().max() < 1e-6
    assert (token_divergence(a, b, kind) > 1e-4).all()


def test_mask_averages_only_the_kept_positions():
    student = torch.stack([_logits(Q)[0], _logits(P)[0], _logits(Q)[0]])[None]  # (1, 3, 2)
    teacher = torch.stack([_logits(P)[0], _logits(P)[0], _logits(P)[0]])[None]
    mask = torch.tensor([[True, True, False]])
    assert float(masked_divergence(student, teacher, mask, "tvd")) == pytest.approx(TVD / 2, rel=1e-5)
    empty = masked_divergence(student.requires_grad_(), teacher, torch.zeros_like(mask), "fkl")
    assert float(empty.detach()) == 0.0
    empty.backward()


def test_gradient_moves_the_student_toward_the_teacher():
    student = _logits(Q).clone().requires_grad_()
    token_divergence(student, _logits(P), "tvd").sum().backward()
    assert student.grad[0, 0] > 0 > student.grad[0, 1]  # lower the over-confident first token


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="divergence must be one of"):
        token_divergence(_logits(Q), _logits(P), "kl")
    with pytest.raises(ValueError, match="beta must be in"):
        token_divergence(_logits(Q), _logits(P), "jsd", beta=1.5)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        token_divergence(_logits(Q), _logits(P), "fkl", temperature=0)
    with pytest.raises(ValueError, match="same vocabulary"):
        token_divergence(torch.zeros(1, 3), torch.zeros(1, 4), "fkl")
