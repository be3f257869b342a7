"""Several drafters at once, the best chosen per step and per row (`A|B` in the drafter grammar).

Per step the members that cost nothing to ask (n-gram lookup, suffix matches) propose first. Each
proposal is valued at its expected accepted tokens per second of verification: (1 + the member's
own estimate, `DraftTree.scores` or its number of drafts, times the member's calibration:
accepted / estimated, decayed) over the measured seconds of verifying its rows
(`specdec.drafters.cut.BlockCosts`, timed by the decode loop); a plain step is the proposal of
nothing. A costly member (`Drafter.costly`: a draft model, a forward per token) runs for a row only
where running it has paid: its `AskGate` compares the measured tokens per second of the steps that ran it against
those that did not, per bin of how much better than a plain step the best proposal in hand already
is, and tries the other choice now and then to stay measured (llama.cpp's chained speculation and
ArcticInference's suffix + model hybrid choose among proposals alike; their estimates, not
measurements, decide when the model runs, which on a 4-bit CPU target asked the 0.5B draft where it
lost a fifth of the suffix's speed). Each row then verifies the proposal with the most expected
tokens per second (drafting done is no longer a cost; a member that cuts its proposal, as the
suffix drafter does, has already weighed it against a plain step). The loop's `auto` draft length
learns only from rows that verified a member drafting k (`DraftTree.tuned`).

A costly member also costs something to start on a row: a draft model prefills the prompt (on the
4-bit 0.5B ~0.45 s for 150 tokens, a tenth of a 128-token answer's decoding), and the steps it then
wins must pay for that. So it is started on a row only when the gate first asks for it there, and
then as a second, slower gate says: the last ROWS rows with it started (start-up included) decoded
more tokens per second than the last ROWS rows where it was declined (medians: a row that compiled a
program says nothing); the other choice is taken once in START_EXPLORE rows.

What a composite learns of its members (calibration, the gates) outlives a generate() call: a
composite made from a spec keeps it per process and per spec text (`shared_records`; `specdec eval`
keeps it per method). Verification costs are measured afresh per call.
"""

from __future__ import annotations

import bisect
import dataclasses
import statistics
import threading
import time
from collections import deque

import torch

from specdec.drafter import Accepted, Drafter, DraftTree
from specdec.drafters.cut import OUTLIER, BlockCosts
from specdec.drafters.group import DrafterGroup

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


_SHARED: dict[str, list[MemberRecord]] = {}
_SHARED_LOCK = threading.Lock()


def shared_records(name: str, members: int) -> list[MemberRecord]:
    """The process's records of the composite spelt `name` (its spec text), one per member: what
    every composite made from that spec learns from and starts with."""
    with _SHARED_LOCK:
        records = _SHARED.setdefault(name, [MemberRecord() for _ in range(members)])
    if len(records) != members:
        raise ValueError(f"composite {name!r} has {members} members but its records hold {len(records)}")
    return records


@dataclasses.dataclass(frozen=True)
class GateChoice:
    """One row's choice at a costly member's gate: the member, the bin and whether it ran."""

    member: int
    bin: int
    ran: bool


class CompositeDrafter(DrafterGroup):
    """Members asked per step (module docstring); each row verifies the proposal worth most per second."""

    def __init__(self, drafters: list[Drafter], records: list[MemberRecord] | None = None) -> None:
        """`records`: what is known of the members, updated in place (default: fresh, this
        drafter's own; a spec's composite passes the process's, `shared_records`)."""
        if len(drafters) < 2:
            raise ValueError(f"a composite drafter chooses among two or more drafters, got {len(drafters)}")
        reads = [d.name for d in drafters if d.needs_hidden or d.hidden_layers]
        if reads:
            raise ValueError(f"a composite drafter asks drafters that read no target states (ngram, suffix, "
                             f"draft models); {', '.join(reads)} reads the target's hidden states: pass it alone")
        self.drafters = drafters
        self.name = "|".join(d.name for d in drafters)
        self.adaptive = any(d.adaptive for d in drafters)
        self.costly = any(d.costly for d in drafters)
        if records is not None and len(records) != len(drafters):
            raise ValueError(f"a composite of {len(drafters)} drafters takes {len(drafters)} records, "
                             f"got {len(records)}")
        self.records = [MemberRecord() for _ in drafters] if records is None else records
        self.costs = BlockCosts()  # this call's verification seconds by block size
        self.chosen: list[int] = []  # per row: the member whose proposal was verified last step (-1: none)
        self.raw: list[float] = []  # per row: that proposal's expected accepted tokens, before calibration
        self.gated: dict[int, list[GateChoice]] = {}  # row -> its gate choices of the last step
        # (member, row) -> whether the member was started on the row, and the row's [tokens, seconds] in its record
        self.decided: dict[tuple[int, int], tuple[bool, list[float]]] = {}
        self.proposed: list[int] = []  # the rows of the last propose
        self._start = 0.0  # when the last step's propose began

    def max_nodes(self, k: int) -> int:
        return max(d.max_nodes(k) for d in self.drafters)

    def draft_cost(self, k: int) -> float:
        return max(d.draft_cost(k) for d in self.drafters if d.adaptive) if self.adaptive else 0.0

    def begin(self, prompts: list[torch.Tensor], max_len: int, hidden: torch.Tensor | None) -> None:
        super().begin(prompts, max_len, hidden)
        self.costs = BlockCosts()
        self.gated, self.decided, self.proposed, self._start = {}, {}, [], 0.0

    def admit(self, row: int, prompt: torch.Tensor, hidden: torch.Tensor | None) -> None:
        self._forget(row)
        super().admit(row, prompt, hidden)

    def release(self, row: int) -> None:
        self._forget(row)
        super().release(row)

    def _forget(self, row: int) -> None:
        self.decided = {key: v for key, v in self.decided.items() if key[1] != row}

    @staticmethod
    def _estimate(tree: DraftTree, b: int) -> float:
        """A member's raw estimate of the accepted length of row b's proposal in `tree`."""
        n = int(tree.lens[b])
        if not n:
            return 0.0
        return float(tree.scores[b, :n].sum()) if tree.scores is not None else float(n)

    def _verify_s(self, rows: int) -> float:
        """Seconds of verifying `rows` rows (1.0 for every size until one is measured: then the
        choice is by expected tokens)."""
        return self.costs.cost(rows) if self.costs.sizes() else 1.0

    def _gate(self, i: int, rows: list[int], best_rate: dict[int, float], plain_rate: float) -> list[int]:
        """The rows costly member i drafts for this step: where its gate asks for it and it is started
        on the row, or is started there now (a start-up step is no gate's: its row's rate has it).
        Every other row's choice is kept for the gate (`gated`)."""
        record, ask = self.records[i], []
        for b in rows:
            gate_bin = AskGate.bin(best_rate[b] / plain_rate)
            wanted = record.gate.ask(gate_bin)
            if wanted and (i, b) not in self.decided:
                started = record.should_start()
                self.decided[i, b] = (started, record.new_row(started))
                if started:
                    ask.append(b)
                    continue
            ran = wanted and self.decided[i, b][0]
            if ran:
                ask.append(b)
            self.gated.setdefault(b, []).append(GateChoice(i, gate_bin, ran))
        return ask

    def propose(self, seqs: list[torch.Tensor], k: int, rows: list[int]) -> DraftTree:
        self._start, self.gated, self.proposed = time.perf_counter(), {}, list(rows)
        B = len(seqs)
        plain_rate = 1.0 / self._verify_s(1)
        best_rate = {b: plain_rate for b in rows}  # a plain step: one token per verification
        trees: dict[int, DraftTree] = {}
        raw = torch.zeros(len(self.drafters), B)  # (M, B)
        rate = torch.full((len(self.drafters), B), -1.0)  # (M, B): expected tokens per second; -1 = not asked
        order = sorted(range(len(self.drafters)), key=lambda i: (self.drafters[i].costly,
                                                                   self.drafters[i].draft_cost(k)))
        for i in order:  # cheapest first: a costly member's gate reads the best proposal in hand
            d, record = self.drafters[i], self.records[i]
            ask = self._gate(i, rows, best_rate, plain_rate) if d.costly else list(rows)
            if not ask:
                continue
            tree = trees[i] = d.propose(seqs, k, ask)
            for b in ask:
                raw[i, b] = self._estimate(tree, b)
                n = int(tree.lens[b])
                rate[i, b] = (1 + float(raw[i, b]) * record.calibration()) / self._verify_s(n + 1) if n else -1.0
                best_rate[b] = max(best_rate[b], float(rate[i, b]))
        chosen = rate.argmax(0)  # (B,): ties go to the first member
        self.chosen = [int(chosen[b]) if b in rows and rate[chosen[b], b] > 0 else -1 for b in range(B)]
        self.raw = [float(raw[c, b]) if c >= 0 else 0.0 for b, c in enumerate(self.chosen)]
        return self._combine(trees, B)

    def _combine(self, trees: dict[int, DraftTree], B: int) -> DraftTree:
        """One DraftTree: each row's chosen proposal (padding nodes chain after its last)."""
        n = max([int(trees[c].lens[b]) for b, c in enumerate(self.chosen) if c >= 0], default=0)
        tokens = torch.zeros(B, n, dtype=torch.long)  # (B, N)
        parents = (torch.arange(n) - 1)[None].repeat(B, 1)  # (B, N)
        lens = torch.zeros(B, dtype=torch.long)  # (B,)
        scores = torch.zeros(B, n)  # (B, N)
        tuned = torch.zeros(B, dtype=torch.bool)  # (B,)
        sampled = [t.q for t in trees.values() if t.q is not None]
        q = None
        for b, c in enumerate(self.chosen):
            if c < 0:
                continue
            tree, m = trees[c], int(trees[c].lens[b])
            tokens[b, :m], parents[b, :m], lens[b] = tree.tokens[b, :m], tree.parents[b, :m], m
            if tree.scores is not None:
                scores[b, :m] = tree.scores[b, :m]
            tuned[b] = self.drafters[c].adaptive
        if sampled:  # one-hot q for deterministic proposals (a deterministic tree's siblings are distinct)
            q = torch.nn.functional.one_hot(tokens, sampled[0].shape[-1]).to(sampled[0])  # (B, N, V)
            for b, c in enumerate(self.chosen):
                if c >= 0 and trees[c].q is not None:
                    m = int(lens[b])
                    q[b, :m] = trees[c].q[b, :m].to(q)
        return DraftTree(tokens, parents, lens, q, scores, tuned)

    def commit(self, accepted: Accepted) -> None:
        """Tell each member which rows verified its proposal; learn the block's cost, the chosen
        members' calibration, and charge the step (its propose to now) to its rows' gate choices and
        start decisions."""
        for i, d in enumerate(self.drafters):
            d.commit(dataclasses.replace(accepted, verified=[c == i for c in self.chosen]))
        if accepted.target_s > 0:
            self.costs.observe(accepted.block, accepted.target_s)
        for b, c in enumerate(self.chosen):
            if c >= 0:
                self.records[c].observe(self.raw[b], len(accepted.paths[b]))
        seconds = time.perf_counter() - self._start  # this step's drafting and verification
        if not (self.costs.sizes() and seconds > OUTLIER * self._verify_s(1)):  # else a compile, not a step
            for b, choices in self.gated.items():
                for c in choices:
                    self.records[c.member].gate.observe(c.bin, c.ran, 1 + len(accepted.paths[b]), seconds)
        for (_, b), (_, row) in self.decided.items():
            if b in self.proposed:
                row[0] += 1 + len(accepted.paths[b])
                row[1] += seconds

    def source(self, row: int) -> str:
        c = self.chosen[row] if row < len(self.chosen) else -1
        return self.drafters[c].name if c >= 0 else self.name


class CompositeDraft(tuple):
    """generate()'s draft argument for `A|B`: the members' draft arguments, which generate() turns
    into drafters with its sampling and joins in a CompositeDrafter (a plain list is a hybrid), and
    the records that composite starts from and updates (None: fresh)."""

    records: list[MemberRecord] | None

    def __new__(cls, members, records: list[MemberRecord] | None = None) -> CompositeDraft:
        draft = super().__new__(cls, members)
        draft.records = records
        return draft


def from_spec(spec, target, loader) -> CompositeDraft:
    """`A|B[|C...]` (specdec.drafters.spec): its members' draft arguments and the loader's records
    of the composite spelt as `spec` (`DrafterLoader.composite_records`)."""
    members = [m.load(target, loader) for m in spec.members]
    return CompositeDraft(members, loader.composite_records(str(spec), len(members)))
