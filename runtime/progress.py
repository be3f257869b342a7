"""runtime.progress: the progress bar of every long job, readable in a terminal and in a log.

In a terminal this is tqdm as usual. When stderr is not a terminal (CI, `make demo > log`), a
bar redraws at most every `LOG_INTERVAL_S` seconds and in plain ASCII, so a log file gets a line
every half-minute instead of hundreds of redraws. tqdm's environment variables still apply:
`TQDM_MININTERVAL` sets another interval, `TQDM_DISABLE=1` turns every bar off.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable

from tqdm.auto import tqdm

LOG_INTERVAL_S = 30.0


def progress(iterable: Iterable | None = None, *, desc: str, total: float | None = None,
             unit: str = "it", disable: bool = False, **kwargs) -> tqdm:
    """A tqdm bar over `iterable` (or updated by hand when None) that stays quiet in logs."""
    if not sys.stderr.isatty():
        if "TQDM_MININTERVAL" not in os.environ:
            kwargs.setdefault("mininterval", LOG_INTERVAL_S)
        kwargs.setdefault("ascii", True)
    return tqdm(iterable, desc=desc, total=total, unit=unit, disable=disable, file=sys.stderr, **kwargs)
