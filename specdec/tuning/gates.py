"""The clocks a composite drafter (`A|B`, `specdec.drafters.composite`) decides by: per member, its
calibration (accepted / expected tokens of the proposals verified) and, for a member that runs a
model, the gates that say where running it pays.

`AskGate` keeps, per bin of how much better than a plain step the best proposal in hand already
is, the decayed tokens and seconds of the steps that ran the member and of those that did not; the
member runs where running has measured faster, and the other choice is taken now and then so both
stay measured. Starting a costly member on a row (a draft model's prefill of the prompt) has a
second, slower gate in `MemberRecord.should_start`: the last ROWS rows with it started against the
last ROWS rows where it was declined (medians of their tokens per second).

What these records learn outlives a generate() call: the tuning state that owns them
(`specdec.tuning.state.TuningState`) keeps one list per composite spec text.
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque

DECAY = 0.9  # weight of the past in a member's calibration
GATE_DECAY = 0.95  # weight of the past in a gate's tokens and seconds
GATE_EDGES = (1.05, 1.4, 2.0)  # bins of the best rate in hand, as a multiple of a plain step's
EXPLORE = 48  # a gate takes the choice it has not taken for this many steps of a bin once (replayed: 12-96)
ROWS = 8  # rows with and without a member started whose decoding rates decide the next row's start
START_EXPLORE = 8  # the choice of starting a member or not that has decoded slower is taken once in this many rows


class AskGate:
    """Whether to run a costly member for a row: per bin of the best rate already in hand (a multiple
    of a plain step's, `GATE_EDGES`), the decayed tokens emitted and seconds spent by the steps that
    ran the member and by those that did not; it runs where running has measured faster. A choice
    never measured in a bin is taken first (running first); one not taken for EXPLORE steps of its
    bin is taken once, so both stay measured as the text changes."""

    def __init__(self) -> None:
        bins = len(GATE_EDGES) + 1
        self.tokens = [[0.0, 0.0] for _ in range(bins)]  # [bin][ran]
        self.seconds = [[0.0, 0.0] for _ in range(bins)]
        self.idle = [[0, 0] for _ in range(bins)]  # [bin][ran]: steps of the bin since that choice was taken

    @staticmethod
    def bin(gain: float) -> int:
        """The bin of a best rate in hand `gain` times a plain step's."""
        return bisect.bisect_right(GATE_EDGES, gain)

    def rate(self, b: int, ran: bool) -> float | None:
        """Measured tokens per second in bin b of the steps that ran (or did not run) the member."""
        return self.tokens[b][ran] / self.seconds[b][ran] if self.seconds[b][ran] else None

    def ask(self, b: int) -> bool:
        """Whether to run the member for a row in bin b."""
        ran, skipped = self.rate(b, True), self.rate(b, False)
        if ran is None or skipped is None:
            return ran is None
        best = ran > skipped
        return (not best) if self.idle[b][not best] >= EXPLORE else best

    def observe(self, b: int, ran: bool, tokens: int, seconds: float) -> None:
        """A step of bin b that ran the member (or not): the row's emitted tokens and the step's seconds."""
        self.tokens[b][ran] = GATE_DECAY * self.tokens[b][ran] + tokens
        self.seconds[b][ran] = GATE_DECAY * self.seconds[b][ran] + seconds
        self.idle[b][ran] = 0
        self.idle[b][not ran] += 1


class MemberRecord:
    """What a composite knows of a member: its decayed accepted / expected tokens over the rows that
    verified its proposal, and, for a costly member, the gate that says where running it pays and the
    tokens and seconds of the last ROWS rows with it started and with it declined."""

    def __init__(self) -> None:
        self.accepted = self.expected = 1.0  # calibration starts at 1: the member's own estimate
        self.steps = 0
        self.gate = AskGate()
        self.rows: tuple[deque, deque] = (deque(maxlen=ROWS), deque(maxlen=ROWS))  # [started]: [tokens, seconds]
        self.idle_rows = [0, 0]  # [started]: rows decided since that choice was last taken

    def row_rate(self, started: bool) -> float | None:
        """The median tokens per second of the last rows with the member started (or declined)."""
        rates = [tokens / seconds for tokens, seconds in self.rows[started] if seconds > 0]
        return statistics.median(rates) if rates else None

    def should_start(self) -> bool:
        """Whether to start the member on a new row: started first, then declined, while either is
        unmeasured; then the choice whose rows decode faster, the other once in START_EXPLORE rows."""
        started, declined = self.row_rate(True), self.row_rate(False)
        if started is None or declined is None:
            choice = started is None
        else:
            best = started > declined
            choice = (not best) if self.idle_rows[not best] >= START_EXPLORE - 1 else best
        self.idle_rows[choice] = 0
        self.idle_rows[not choice] += 1
        return choice

    def new_row(self, started: bool) -> list[float]:
        """A row's [tokens, seconds], kept among the rows with the member started (or declined), for
        the caller to add each of the row's steps to."""
        self.rows[started].append([0, 0.0])
        return self.rows[started][-1]

    def calibration(self) -> float:
        return min(max(self.accepted / self.expected, 0.05), 2.0)

    def observe(self, expected: float, accepted: int) -> None:
        self.accepted = DECAY * self.accepted + accepted
        self.expected = DECAY * self.expected + max(expected, 1e-3)
        self.steps += 1
