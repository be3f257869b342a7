"""runtime.argtypes: argparse types that convert, then check, and report against the flag."""

import argparse
import re

import pytest

from runtime.argtypes import int_at_least, nonnegative_float, nonnegative_int, positive_float, positive_int


def _parser(kind) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prog", exit_on_error=False)
    parser.add_argument("--n", type=kind)
    return parser


@pytest.mark.parametrize("kind, good, bad", [
    (positive_int, {"1": 1, "64": 64}, {"0": "must be >= 1, got 0", "-2": "must be >= 1, got -2",
                                         "1.5": "expected an integer, got '1.5'"}),
    (nonnegative_int, {"0": 0, "3": 3}, {"-1": "must be >= 0, got -1", "x": "expected an integer, got 'x'"}),
    (positive_float, {"0.5": 0.5, "2": 2.0}, {"0": "must be > 0, got 0.0", "-1": "must be > 0, got -1.0",
                                              "inf": "expected a finite number, got 'inf'",
                                              "nan": "expected a finite number, got 'nan'"}),
    (nonnegative_float, {"0": 0.0, "1.5": 1.5}, {"-0.1": "must be >= 0, got -0.1"}),
    (int_at_least(2), {"2": 2}, {"1": "must be >= 2, got 1"}),
])
def test_values_are_converted_then_checked(kind, good, bad):
    for text, value in good.items():
        assert _parser(kind).parse_args(["--n", text]).n == value
    for text, message in bad.items():
        with pytest.raises(argparse.ArgumentError, match=f"argument --n: {re.escape(message)}$"):
            _parser(kind).parse_args(["--n", text])
