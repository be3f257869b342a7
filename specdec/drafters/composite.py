"""Several drafters at once, the best chosen per step and per row (`A|B` in the method grammar).

Per step the members that cost nothing to ask (n-gram lookup, suffix matches) propose first. Each
proposal is valued at its expected accepted tokens per second of verification: (1 + the member's
own estimate, `DraftTree.scores` or its number of drafts, times the member's calibration:
accepted / estimated, decayed) over the measured seconds of verifying its rows
(`specdec.tuning.costs.BlockCosts`, timed by the decode loop); a plain step is the proposal of
nothing. A member that runs a model (`Drafter.runs_model`: a forward per token) runs for a row only
where running it has paid, as its gates measure (`specdec.tuning.gates`: `AskGate` per step,
`MemberRecord.should_start` per row, since starting a draft model on a row costs a prefill of the
prompt). Each row then verifies the proposal with the most expected tokens per second (drafting
done is no longer a cost; a member that cuts its proposal, as the suffix drafter does, has already
weighed it against a plain step). The loop's `auto` draft length learns only from rows that
verified a member drafting k (`DraftTree.sized_by_k`).

The members' records (`MemberRecord`: calibration and gates) are passed in: a composite made from
a spec gets them from its loader's tuning state (`specdec.tuning.state.TuningState`, one list per
spec text, kept across generate() calls); verification costs are measured afresh per call.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from specdec.drafter import Accepted, Drafter, DraftTree
from specdec.drafters.members import MemberDrafters
from specdec.tuning.costs import OUTLIER, BlockCosts
from specdec.tuning.gates import AskGate, MemberRecord


@dataclasses.dataclass(frozen=True)
class GateChoice:
    """One row's choice at a costly member's gate: the member, the bin and whether it ran."""

    member: int
    bin: int
    ran: bool


class CompositeDrafter(MemberDrafters):
    """Members asked per step (module docstring); each row verifies the proposal worth most per second."""

    def __init__(self, drafters: list[Drafter], records: list[MemberRecord] | None = None) -> None:
        """`records`: what is known of the members, updated in place (default: fresh, this
        drafter's own; a spec's composite passes its loader's, `TuningState.composite_records`)."""
        if len(drafters) < 2:
            raise ValueError(f"a composite drafter chooses among two or more drafters, got {len(drafters)}")
        reads = [d.name for d in drafters if d.needs_hidden or d.hidden_layers]
        if reads:
            raise ValueError(f"a composite drafter asks drafters that read no target states (ngram, suffix, "
                             f"draft models); {', '.join(reads)} reads the target's hidden states: pass it alone")
        self.drafters = drafters
        self.name = "|".join(d.name for d in drafters)
        self.adaptive = any(d.adaptive for d in drafters)
        self.runs_model = any(d.runs_model for d in drafters)
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
        order = sorted(range(len(self.drafters)), key=lambda i: (self.drafters[i].runs_model,
                                                                   self.drafters[i].draft_cost(k)))
        for i in order:  # cheapest first: a costly member's gate reads the best proposal in hand
            d, record = self.drafters[i], self.records[i]
            ask = self._gate(i, rows, best_rate, plain_rate) if d.runs_model else list(rows)
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
        sized_by_k = torch.zeros(B, dtype=torch.bool)  # (B,)
        sampled = [t.q for t in trees.values() if t.q is not None]
        q = None
        for b, c in enumerate(self.chosen):
            if c < 0:
                continue
            tree, m = trees[c], int(trees[c].lens[b])
            tokens[b, :m], parents[b, :m], lens[b] = tree.tokens[b, :m], tree.parents[b, :m], m
            if tree.scores is not None:
                scores[b, :m] = tree.scores[b, :m]
            sized_by_k[b] = self.drafters[c].adaptive
        if sampled:  # one-hot q for deterministic proposals (a deterministic tree's siblings are distinct)
            q = torch.nn.functional.one_hot(tokens, sampled[0].shape[-1]).to(sampled[0])  # (B, N, V)
            for b, c in enumerate(self.chosen):
                if c >= 0 and trees[c].q is not None:
                    m = int(lens[b])
                    q[b, :m] = trees[c].q[b, :m].to(q)
        return DraftTree(tokens, parents, lens, q, scores, sized_by_k)

    def commit(self, accepted: Accepted) -> None:
        """Tell each member which rows verified its proposal; learn the block's cost, the chosen
        members' calibration, and charge the step (its propose to now) to its rows' gate choices and
        start decisions."""
        for i, d in enumerate(self.drafters):
            d.commit(dataclasses.replace(accepted, verified=[c == i for c in self.chosen]))
        if accepted.target_s > 0:
            self.costs.observe(accepted.block, accepted.target_s, accepted.step)
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
    """`A|B[|C...]` (specdec.methods): its members' draft arguments and the loader's records of the
    composite spelt as `spec` (`specdec.loader.DrafterLoader.composite_records`)."""
    members = [m.load(target, loader) for m in spec.members]
    return CompositeDraft(members, loader.composite_records(str(spec), len(members)))
