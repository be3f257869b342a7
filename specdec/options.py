"""Checks of the decoding options, shared by `specdec.generate` and `specdec eval`."""

from __future__ import annotations

import math

MAX_NUM_DRAFT_TOKENS = 64


def check_sampling(temperature: float, top_p: float, top_k: int) -> None:
    """Raise ValueError unless 0 <= temperature < inf (0 = greedy), 0 < top_p <= 1, top_k >= 0."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {top_k!r}")


def parse_draft_length(value: int | str) -> int | str:
    """num_draft_tokens as an int in [1, 64] or "auto"; a decimal string (from a command line)
    is read as its int."""
    if value == "auto":
        return value
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"num_draft_tokens must be an integer >= 1 or 'auto', got {value!r}")
    if not 1 <= value <= MAX_NUM_DRAFT_TOKENS:
        raise ValueError(f"num_draft_tokens must be between 1 and {MAX_NUM_DRAFT_TOKENS} or 'auto', got {value}")
    return value


WEIGHTS_HELP = ("how a GGUF model (catalogue name, .gguf file) holds its weights: gguf = its 4-bit blocks, run by "
                "the CPU kernels; dense = dequantized to --dtype; auto = gguf where the CPU has AVX-512 VNNI "
                "(default: %(default)s)")
