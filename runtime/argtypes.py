"""Value checks and argparse types for counts, sizes and durations.

A check (`positive`, `at_least(low)`) raises ValueError("must be ...") for a bad value; config
dataclasses use them on their fields (distill.config_args). `number_arg(kind, check)` turns one
into an argparse `type`: the text is converted, then checked, and argparse reports a failure
against the flag (`argument --max-minutes: must be > 0, got -1.0`, exit status 2) while the
command line is parsed, before any model loads. The usual ones are named:

    positive_int       counts and sizes that must be >= 1 (--batch-size, --num-prompts, ...)
    nonnegative_int    counts where 0 means none (--eval-samples, --heldout-prompts, ...)
    positive_float     durations (--max-minutes: omit it for no limit)
    nonnegative_float  temperatures (0 = greedy)
    unit_interval      probabilities in (0, 1] (--top-p)
    port_number        TCP ports, 0-65535
    seed_number        generator seeds, 0 to 2**63 - 1
    path_arg           paths, never empty
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any


def at_least(low: float) -> Callable[[float], None]:
    """A check that accepts values >= `low`."""
    def check(value: float) -> None:
        if value < low:
            raise ValueError(f"must be >= {low}, got {value}")
    return check


def positive(value: float) -> None:
    """A check that accepts values > 0."""
    if value <= 0:
        raise ValueError(f"must be > 0, got {value}")


def within(low: float, high: float, low_open: bool = False) -> Callable[[float], None]:
    """A check that accepts values in [low, high] (in (low, high] with `low_open`)."""
    def check(value: float) -> None:
        if value > high or value < low or low_open and value == low:
            raise ValueError(f"must be in {'(' if low_open else '['}{low}, {high}], got {value}")
    return check


def number_arg(kind: type, check: Callable[[Any], None]) -> Callable[[str], Any]:
    """An argparse `type`: `kind(text)` (int or float; a float must be finite), then `check`; either
    failure is an ArgumentTypeError that argparse reports against the flag."""
    noun = "an integer" if kind is int else "a number"

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {noun}, got {text!r}") from None
        if isinstance(value, float) and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
        try:
            check(value)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
        return value

    return parse


positive_int = number_arg(int, at_least(1))
nonnegative_int = number_arg(int, at_least(0))
positive_float = number_arg(float, positive)
nonnegative_float = number_arg(float, at_least(0))
unit_interval = number_arg(float, within(0, 1, low_open=True))  # top-p
port_number = number_arg(int, within(0, 65535))
seed_number = number_arg(int, within(0, 2**63 - 1))  # what torch.Generator.manual_seed takes without overflow


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse `type` for an integer >= `low` (e.g. a window length, which needs 2 tokens)."""
    return number_arg(int, at_least(low))


def path_arg(text: str) -> Path:
    """An argparse `type` for a file or directory path: not empty (Path("") would be the current
    directory, which nobody means)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path; give a file or directory path")
    return Path(text)
