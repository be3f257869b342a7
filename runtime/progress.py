"""runtime.progress: the progress bar of every long job, readable in a terminal and in a log.

In a terminal this is tqdm as usual. When stderr is not a terminal (CI, `make demo > log`), a
bar redraws at most every `LOG_INTERVAL_S` seconds and in plain ASCII, so a log file gets a line
every 10 seconds (no long silence) instead of hundreds of redraws. tqdm's environment variables still apply:
`TQDM_MININTERVAL` sets another interval, `TQDM_DISABLE=1` turns every bar off.

A bar whose steps are long (a download, a conversion) is redrawn every `HEARTBEAT_S` seconds inside
`keep_alive(bar)`, so its elapsed time shows that the job is alive; a wait without a bar (a model's
load, a server's start) says `still WHAT (N s)` as often inside `still(what, say)`.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from tqdm.auto import tqdm

LOG_INTERVAL_S = 10.0
HEARTBEAT_S = 10.0


def progress(iterable: Iterable | None = None, *, desc: str, total: float | None = None,
             unit: str = "it", disable: bool = False, **kwargs) -> tqdm:
    """A tqdm bar over `iterable` (or updated by hand when None) that stays quiet in logs."""
    if not sys.stderr.isatty():
        if "TQDM_MININTERVAL" not in os.environ:
            kwargs.setdefault("mininterval", LOG_INTERVAL_S)
        kwargs.setdefault("ascii", True)
    return tqdm(iterable, desc=desc, total=total, unit=unit, disable=disable, file=sys.stderr, **kwargs)


@contextmanager
def keep_alive(bar: tqdm, every: float = HEARTBEAT_S) -> Iterator[tqdm]:
    """Redraw `bar` every `every` seconds (from a daemon thread) while the block runs."""
    if bar.disable:
        yield bar
        return
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(every):
            bar.refresh()

    thread = threading.Thread(target=beat, name="progress-keep-alive", daemon=True)
    thread.start()
    try:
        yield bar
    finally:
        stop.set()
        thread.join()


@contextmanager
def still(what: str, say: Callable[[str], None], every: float = HEARTBEAT_S) -> Iterator[None]:
    """Call say("  still WHAT (N s)...") every `every` seconds (from a daemon thread) while the block runs."""
    stop, start = threading.Event(), time.monotonic()

    def beat() -> None:
        while not stop.wait(every):
            say(f"  still {what} ({time.monotonic() - start:.0f} s)...")

    thread = threading.Thread(target=beat, name="progress-still", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
