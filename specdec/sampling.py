"""Logits processing shared by decoding and verification: temperature, top-k, top-p, sampling.

Draft and target distributions go through the same `probs_from_logits`, so speculative
sampling reproduces exactly the distribution plain sampling would use.
"""

from __future__ import annotations

import torch


class NonFiniteLogitsError(FloatingPointError):
    """The model produced NaN logits (a broken checkpoint, or overflow in a low precision)."""


def check_finite(logits: torch.Tensor, who: str = "target") -> None:
    """Raise when `logits` hold NaN (inf is a legal -inf mask value only when not everywhere)."""
    if bool(torch.isnan(logits.amax(-1)).any()):  # a row's max is NaN iff the row holds one: no (.., V) copy
        raise NonFiniteLogitsError(
            f"the {who} model produced NaN logits; the checkpoint may be corrupt, or the dtype "
            "overflows (try dtype=torch.float32 or bfloat16 instead of float16)")


def probs_from_logits(logits: torch.Tensor, temperature: float, top_k: int = 0,
                      top_p: float = 1.0) -> torch.Tensor:
    """Sampling distribution (..., V) float32 from logits (..., V) with temperature > 0."""
    scores = logits.float() / temperature
    vocab = scores.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]  # (..., 1)
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        cum = sorted_scores.softmax(-1).cumsum(-1)
        drop_sorted = cum - sorted_scores.softmax(-1) >= top_p  # keep the smallest set reaching p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of probs (N, V) -> (N,)."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def select_next(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                generator: torch.Generator | None) -> torch.Tensor:
    """Next token per row from logits (N, V): argmax at temperature 0, else a sample -> (N,)."""
    check_finite(logits)
    if temperature == 0:
        return logits.argmax(-1)
    return sample(probs_from_logits(logits, temperature, top_k, top_p), generator)
