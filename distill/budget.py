"""A wall-clock budget for a long, resumable job that holds across restarts.

`RunBudget(path, max_minutes)` starts the clock with the minutes an earlier run of the same job
already spent (read from `path`, a small JSON file) and rewrites that file every `every`
seconds while the job runs, so a job stopped at any point (Ctrl-C, a killed machine) and started
again goes on against the same budget instead of a fresh one. Deadlines are time.monotonic()
values, as the pipelines' `deadline=` parameters take them. `run_budgeted` is the frame the
training recipes (Medusa, EAGLE-3) run their steps in.
"""

from __future__ import annotations

import json
import math
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from runtime.atomic import atomic_write_text
from runtime.hardware import native_bf16
from runtime.output_paths import prepare_output_dir


class RunBudget:
    """`max_minutes` of wall clock for the job whose progress file is `path`.

    at(frac): the deadline by which `frac` of the budget is spent. minutes(): the minutes spent,
    earlier runs included. Use as a context manager (or call close()) so that the last figure is
    written when the job ends.
    """

    def __init__(self, path: str | Path, max_minutes: float, every: float = 15.0) -> None:
        if max_minutes <= 0:
            raise ValueError(f"max_minutes must be > 0, got {max_minutes}")
        if every <= 0:
            raise ValueError(f"every must be > 0 seconds, got {every}")
        self.path = Path(path)
        self.max_minutes = max_minutes
        self.spent_before = 0.0
        if self.path.is_file():
            try:
                self.spent_before = float(json.loads(self.path.read_text())["spent_minutes"])
                if not math.isfinite(self.spent_before) or self.spent_before < 0:
                    raise ValueError(f"spent_minutes is {self.spent_before}")
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{self.path} is not a budget file ({e}); delete it to start the "
                                 "budget afresh") from e
        self.start = time.monotonic() - 60 * self.spent_before
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tick, args=(every,), daemon=True)
        self.save()
        self._thread.start()

    def at(self, frac: float) -> float:
        """time.monotonic() value at which `frac` of the whole budget is spent."""
        return self.start + frac * 60 * self.max_minutes

    def minutes(self) -> float:
        """Minutes spent so far, earlier runs of the job included."""
        return (time.monotonic() - self.start) / 60

    def save(self) -> None:
        """Write the minutes spent so far (and the budget, for whoever reads the file)."""
        atomic_write_text(self.path, json.dumps({"spent_minutes": round(self.minutes(), 4),
                                                 "max_minutes": self.max_minutes}))

    def _tick(self, every: float) -> None:
        while not self._stop.wait(every):
            try:
                self.save()
            except OSError as e:  # a full disk must not end the job; the next tick tries again
                warnings.warn(f"could not record the budget in {self.path}: {e}", stacklevel=1)

    def close(self) -> None:
        """Stop the clock's writer and record the final figure."""
        self._stop.set()
        self._thread.join()
        self.save()

    def __enter__(self) -> RunBudget:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _stop(signum: int, frame) -> None:
    """SIGTERM: unwind like Ctrl-C (finally blocks write what they hold); a second one waits."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit(128 + signum)


def default_train_frac(args: Any) -> float:
    """The share of the budget by which training ends when --train-frac is not given: all but
    eval_minutes, but on a short budget at least half of what the data phase leaves."""
    return max(1 - args.eval_minutes / args.max_minutes, (1 + args.data_frac) / 2)


def run_budgeted(args: Any, markers: tuple[str, ...], what: str, product: str,
                 steps: Callable[[Path, RunBudget | None], dict], trained: str = "metrics.json") -> dict:
    """The frame the training recipes share: settle args (the training share of the budget, torch
    threads, dtype "auto"), check --out (`runtime.output_paths`: new, empty or a run with `markers`,
    which is resumed) and --eval-only (OUT/metrics.json must hold the trained `product`), then run
    `steps(out, budget)` with a `RunBudget` in OUT/budget.json (None for --eval-only) and SIGTERM
    unwinding like Ctrl-C, so that what a step holds is written and the same command resumes.

    args: the recipe's namespace (out, max_minutes, data_frac, train_frac, eval_minutes, threads,
    dtype, eval_only). trained: the file (relative to OUT) a finished training writes, which
    --eval-only needs.
    """
    if args.train_frac is None:
        args.train_frac = default_train_frac(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.dtype == "auto":
        args.dtype = "bfloat16" if native_bf16() else "float32"
    out = prepare_output_dir(args.out, markers, what=what, resume=True)
    if args.eval_only and not (out / trained).is_file():
        raise SystemExit(f"--eval-only: {out} holds no trained {product} (no {trained}); run the recipe "
                         "without --eval-only first, or point --out at a finished run")
    out.mkdir(parents=True, exist_ok=True)
    budget = None if args.eval_only else RunBudget(out / "budget.json", args.max_minutes)
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        return steps(out, budget)
    finally:
        if budget is not None:
            budget.close()
        signal.signal(signal.SIGTERM, previous)
