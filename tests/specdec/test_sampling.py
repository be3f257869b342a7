"""SamplingParams' bounds: values float32 cannot sample with are refused at validation, naming the
parameter; the least accepted values still give a finite distribution."""

import pytest
import torch

from specdec.sampling import MIN_TEMPERATURE, MIN_TOP_P, SamplingParams, probs_from_logits


@pytest.mark.parametrize("field,value", [("temperature", 1e-45), ("temperature", 1e-31), ("top_p", 1e-300),
                                         ("top_p", 1e-40)])
def test_values_below_what_float32_represents_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=f"^{field} must be") as err:
        SamplingParams(**{field: value})
    assert "\n" not in str(err.value)


def test_the_least_accepted_values_sample_a_finite_distribution():
    params = SamplingParams(temperature=MIN_TEMPERATURE, top_p=MIN_TOP_P)
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 30  # (N, V)
    probs = probs_from_logits(logits, params.temperature, top_p=params.top_p)
    assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(3))
    assert (probs.argmax(-1) == logits.argmax(-1)).all()
    assert SamplingParams(temperature=0.0).greedy  # 0 stays greedy


def test_logits_without_a_vocabulary_are_named():
    """(B, 0) logits were an IndexError from amax."""
    from specdec.sampling import select_next

    with pytest.raises(ValueError, match=r"the target model's logits \(2, 0\) have no vocabulary"):
        select_next(torch.randn(2, 0), 1.0, 0, 1.0, None)
