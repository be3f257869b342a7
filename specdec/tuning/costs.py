"""Verification costs measured while decoding, and the cut of a proposal to the part worth verifying.

Where verification rows are not free (on a CPU a block of 8 rows can cost well over one row), a
drafter that proposes every node its matches allow pays for rows that are rarely accepted. A
proposal's nodes listed best first (parents before children) have prefixes that are trees
themselves; the prefix of n nodes emits 1 + (expected accepted of its nodes) tokens for one
verification of n + 1 rows, so the rule keeps the n (0 = a plain step) that maximises

    (1 + sum of the first n nodes' measured acceptance) / cost(n + 1)

with cost(r) the measured seconds of verifying r rows on this machine (`BlockCosts`, fed by the
decode loop through `Accepted.block` / `Accepted.target_s`) and a node's acceptance measured for
its drafter by the node's own path probability (`NodeCalibration`). In a batch the block is the
longest row's and every row pays for it, so one budget n is chosen for all rows together
(`batch_cut`: the tokens of every row over the cost of one block), not each row as if alone.
"""

from __future__ import annotations

import statistics
import threading
import weakref
from collections import deque
from collections.abc import Callable

SAMPLES = 8  # verification timings kept per block size (their median is its cost)
OUTLIER = 20.0  # a timing above this many times the cheapest block's cost is a compile, not a step


class BlockCosts:
    """Seconds of one verification by its block size (rows scored), measured as decoding goes: the
    median of the last SAMPLES timings per size; a size not measured yet is interpolated linearly
    between the measured sizes around it (past the largest, extended by the last two). With
    `padded(block)`, the length the target runs a block at (a compiled step pads blocks to 2, 4, 8,
    ... tokens: `runtime.model.Transformer.verify_tokens`), sizes are that length: blocks of 5..8
    tokens share the samples of 8 (on 4-bit weights about twice a 4-token block's cost), so a size
    seldom chosen neither waits to be timed nor keeps a stale first timing (a program's first call
    checks its guards)."""

    def __init__(self, padded: Callable[[int], int] | None = None) -> None:
        self._times: dict[int, deque[float]] = {}
        self._steps: deque[int] = deque(maxlen=SAMPLES)  # the numbers of the last verifications recorded
        self.padded = padded

    def observe(self, block: int, seconds: float, step: int = 0) -> None:
        """One verification of `block` rows that took `seconds`. A compile is no step: a timing over
        OUTLIER times the cheapest size's cost is ignored, and one that was kept because it came
        first (nothing cheaper timed yet) is dropped once a step that much faster arrives. step: the
        verification's number (`specdec.drafter.Accepted.step`; 0 = not told): a store shared by the
        draft-length tuner and a drafter records each verification once, whoever tells it first."""
        if block < 1 or seconds <= 0 or (step and step in self._steps):
            return
        if step:
            self._steps.append(step)
        block = self._size(block)
        if self._times and seconds > OUTLIER * min(self.cost(b) for b in self._times):
            return
        for size, times in list(self._times.items()):
            if max(times) > OUTLIER * seconds:  # a compile kept as a first timing
                kept = deque((t for t in times if t <= OUTLIER * seconds), maxlen=SAMPLES)
                if kept:
                    self._times[size] = kept
                else:
                    del self._times[size]
        self._times.setdefault(block, deque(maxlen=SAMPLES)).append(seconds)

    def _size(self, block: int) -> int:
        return self.padded(block) if self.padded is not None else block

    def sizes(self) -> list[int]:
        """The block sizes measured (padded, with `padded`), smallest first."""
        return sorted(self._times)

    def known(self) -> bool:
        """Whether two block sizes were measured (what a cut needs to compare sizes)."""
        return len(self._times) >= 2

    def cost(self, block: int) -> float:
        """Estimated seconds of verifying `block` rows (needs one measured size)."""
        if not self._times:
            raise ValueError("no verification was timed yet")
        block = self._size(block)
        if block in self._times:
            return statistics.median(self._times[block])
        sizes = sorted(self._times)
        below = [s for s in sizes if s < block]
        above = [s for s in sizes if s > block]
        if below and above:
            lo, hi = below[-1], above[0]
        elif above:  # smaller than any measured size: no cheaper than the smallest
            return self.cost(above[0])
        elif len(below) >= 2:
            lo, hi = below[-2], below[-1]
        else:
            return self.cost(below[-1])
        c_lo, c_hi = self.cost(lo), self.cost(hi)
        return max(c_lo + (c_hi - c_lo) * (block - lo) / (hi - lo), min(c_lo, c_hi))


_TARGETS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # target -> {batch size: BlockCosts}
_TARGETS_LOCK = threading.Lock()


def target_costs(target: object, batch_size: int) -> BlockCosts:
    """The verification costs of `target` with `batch_size` rows timed so far in this process: one
    BlockCosts per target object and batch size (padded as the target runs its blocks), shared by
    the generate() calls on it and by the drafters that size their proposals by cost (`auto` draft
    lengths, `suffix`), so each call starts from what earlier calls measured."""
    padded = None
    if hasattr(target, "verify_tokens"):  # held weakly: the store must not keep the target alive
        verify_tokens = weakref.WeakMethod(target.verify_tokens)
        padded = lambda block: verify_tokens()(block, batch_size)  # noqa: E731
    with _TARGETS_LOCK:
        return _TARGETS.setdefault(target, {}).setdefault(batch_size, BlockCosts(padded))


class NodeCalibration:
    """How often a drafter's nodes are accepted, by the drafter's own probability for them: decayed
    accepted / verified counts in `bins` equal bins of [0, 1], each starting at its midpoint (a weak
    prior of `prior` nodes). A drafter's frequency is not a probability of acceptance (a suffix path
    seen once has frequency 1); one ratio for all nodes over-values the weak ones, so each bin is
    valued at what its nodes are measured to bring."""

    def __init__(self, bins: int = 10, prior: float = 2.0, decay: float = 0.98) -> None:
        self.bins, self.decay = bins, decay
        self.accepted = [(b + 0.5) / bins * prior for b in range(bins)]
        self.verified = [prior] * bins

    def _bin(self, p: float) -> int:
        return min(max(int(p * self.bins), 0), self.bins - 1)

    def value(self, p: float) -> float:
        """The measured acceptance of nodes of probability p."""
        b = self._bin(p)
        return self.accepted[b] / self.verified[b]

    def observe(self, probs: list[float], accepted: list[bool]) -> None:
        """Nodes verified in one step: their probabilities and whether each was accepted."""
        for p, ok in zip(probs, accepted):
            b = self._bin(p)
            self.accepted[b] = self.decay * self.accepted[b] + ok
            self.verified[b] = self.decay * self.verified[b] + 1


def best_cut(values: list[float], costs: BlockCosts) -> int:
    """How many of a proposal's first nodes (best first; `values`: each one's chance of acceptance) to
    verify: the n in 0..len(values) with the most expected tokens per second, 0 when a plain step
    beats every cut."""
    return batch_cut([values], costs)


def batch_cut(values: list[list[float]], costs: BlockCosts) -> int:
    """`best_cut` for rows verified together (`values`: one list per row): they pay for one block of
    the longest row's size, so the budget is the n with the most expected tokens of all rows per
    second, (rows + the values of each row's first n nodes) / cost(n + 1); each row then verifies
    at most n nodes (fewer when its proposal is shorter: the block is the batch's anyway)."""
    best, best_rate = 0, len(values) / costs.cost(1)
    expected = 0.0
    for n in range(1, max(map(len, values), default=0) + 1):
        expected += sum(v[n - 1] for v in values if len(v) >= n)
        rate = (len(values) + expected) / costs.cost(n + 1)
        if rate > best_rate:
            best, best_rate = n, rate
    return best
