"""Sampling settings and the logits processing shared by decoding and verification: temperature,
top-k, top-p, sampling.

`SamplingParams` is the one description of how tokens are picked: generate()'s keyword arguments
build one, the engine takes one per request, `specdec eval` derives one from its config. Draft
and target distributions go through the same `probs_from_logits`, so speculative sampling
reproduces exactly the distribution plain sampling would use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from runtime.kernels.cpu_argmax import argmax

# the least nonzero temperature: logits / temperature must stay finite in float32 (|logit| up to ~3e8)
MIN_TEMPERATURE = 1e-30
# the least top_p: float32's smallest normal number (top_p is compared with float32 probabilities, and a
# smaller value rounds to 0 there, which drops every token)
MIN_TOP_P = float(torch.finfo(torch.float32).tiny)


@dataclass(frozen=True)
class SamplingParams:
    """How one request (or generate() call) picks tokens: greedy at temperature 0, else sampled with
    top_k (0 = off) / top_p (1 = off) from a torch.Generator seeded with `seed` (None: the caller's
    generator, or a fresh random seed; `generator`). At most max_new_tokens new tokens;
    stop_token_ids end it (finish_reason "stop") besides the eos ids."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        t, p, k = self.temperature, self.top_p, self.top_k
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if 0 < t < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {t!r}: a smaller "
                             "one overflows float32 logits (use 0 for greedy decoding)")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        if p < MIN_TOP_P:
            raise ValueError(f"top_p must be at least {MIN_TOP_P:.3g} (float32's smallest normal number), got {p!r}: "
                             "a smaller one rounds to 0 in float32 and keeps no token")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {k!r}")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an integer >= 0, got {self.max_new_tokens!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2 ** 63):
            raise ValueError(f"seed must be None or an integer in [0, 2**63), got {self.seed!r}")
        stops = self.stop_token_ids
        if not isinstance(stops, (tuple, list)) or any(isinstance(t, bool) or not isinstance(t, int) or t < 0
                                                        for t in stops):
            raise ValueError(f"stop_token_ids must be a tuple of token ids (ints >= 0), got {stops!r}")
        object.__setattr__(self, "stop_token_ids", tuple(stops))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator | None:
        """A new torch.Generator on `device` for a sampled request (seeded with `seed`, else randomly);
        None when greedy (nothing random)."""
        if self.greedy:
            return None
        gen = torch.Generator(device=device)
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(self.seed)
        return gen


@dataclass(frozen=True, eq=False)
class RowSampling:
    """How one row of a decoding batch picks its tokens: its SamplingParams and the generator that
    makes every random choice of the row (its own, so its output does not depend on the other rows)."""

    params: SamplingParams = SamplingParams()
    generator: torch.Generator | None = None

    @property
    def temperature(self) -> float:
        return self.params.temperature

    @property
    def top_k(self) -> int:
        return self.params.top_k

    @property
    def top_p(self) -> float:
        return self.params.top_p

    @property
    def key(self) -> tuple:
        """Rows with equal keys are verified in one call: every greedy row shares one."""
        return ("greedy",) if self.temperature == 0 else (self.temperature, self.top_k, self.top_p, id(self.generator))


class NonFiniteLogitsError(FloatingPointError):
    """The model produced NaN logits (a broken checkpoint, or overflow in a low precision)."""


def check_finite(logits: torch.Tensor, who: str = "target") -> None:
    """Raise when `logits` hold NaN (inf is a legal -inf mask value only when not everywhere), or
    no vocabulary at all."""
    if not logits.shape[-1:] or logits.shape[-1] == 0:
        raise ValueError(f"the {who} model's logits {tuple(logits.shape)} have no vocabulary dimension to pick from")
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
        return argmax(logits)
    return sample(probs_from_logits(logits, temperature, top_k, top_p), generator)
