"""Checks of the decoding options, shared by `specdec.generate` and `specdec eval` (the sampling
settings' checks live on `specdec.sampling.SamplingParams`)."""

from __future__ import annotations

MAX_NUM_DRAFT_TOKENS = 64
DEFAULT_NUM_DRAFT_TOKENS = 5  # drafts per step of generate(), the engine, specdec eval / serve / generate


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
        raise ValueError(f"num_draft_tokens must be an integer in [1, {MAX_NUM_DRAFT_TOKENS}] or 'auto', got {value}")
    return value


def check_draft_length(value: int | str) -> int | str:
    """num_draft_tokens of the Python API: an int in [1, 64] or "auto". Unlike parse_draft_length
    (which reads command-line text), a string other than "auto" is a TypeError, as "8" is for
    max_new_tokens."""
    if isinstance(value, str) and value != "auto":
        hint = f"; pass {int(value)}, an int" if value.strip().isdigit() else ""
        raise TypeError(f"num_draft_tokens must be an integer in [1, {MAX_NUM_DRAFT_TOKENS}] or 'auto', got {value!r} "
                        f"(str){hint}")
    return parse_draft_length(value)


WEIGHTS_HELP = ("how a GGUF model (catalogue name, .gguf file) holds its weights: gguf = its 4-bit blocks, run by "
                "the CPU kernels; dense = dequantized to --dtype; auto = gguf where the CPU has AVX-512 VNNI or "
                "AVX2 + FMA (default: %(default)s)")
