"""Several drafters at once, the best chosen per step and per row (`A|B` in the drafter grammar).

Per step the members are asked cheapest first (their measured `draft_cost`: n-gram lookup and
suffix matches cost nothing, a draft model a forward per token). Each proposal's expected accepted
length is the member's own estimate (`DraftTree.scores`: suffix frequencies, draft-model
probabilities; else its number of drafts) times the member's calibration (accepted / estimated,
decayed, over the steps it was verified). A costly member runs only for the rows where what it
usually gets accepted, per second of drafting plus verifying its proposals (each member's
verifications are timed apart: a draft model's chain of k is a block of k + 1 rows, which on a
4-bit target costs up to twice a 2-row suffix tree), beats the best proposal in hand
(llama.cpp's chained speculation and ArcticInference's suffix + model hybrid choose the same
way); each row then verifies its proposal with the most expected accepted tokens. The loop's
`auto` draft length learns only from rows that verified a member drafting k (`DraftTree.tuned`).

What a composite learns of its members (calibration and accepted per step) outlives a generate()
call: a composite made from a spec keeps it per process and per spec text (`shared_records`;
`specdec eval` keeps it per method), so a call starts calibrated instead of trusting every member's
own estimate for its first steps. Timings are measured afresh per call (one step each): a compile or
a longer prompt in one call says nothing of the next's.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import torch

from specdec.drafter import Accepted, Drafter, DraftTree
from specdec.drafters.group import DrafterGroup

DECAY = 0.9  # weight of the past in a member's calibration and acceptance averages


class MemberRecord:
    """A member's decayed averages over the rows that verified its proposal: tokens accepted,
    tokens it expected, and accepted per step (what running it is hoped to bring)."""

    def __init__(self) -> None:
        self.accepted = self.expected = 1.0  # calibration starts at 1: the member's own estimate
        self.per_step = 2.0  # optimistic, so every member is tried until it is measured
        self.steps = 0

    def calibration(self) -> float:
        return min(max(self.accepted / self.expected, 0.05), 2.0)

    def observe(self, expected: float, accepted: int) -> None:
        self.accepted = DECAY * self.accepted + accepted
        self.expected = DECAY * self.expected + max(expected, 1e-3)
        self.per_step = DECAY * self.per_step + (1 - DECAY) * accepted
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


def _decayed(average: float, seconds: float) -> float:
    return seconds if not average else DECAY * average + (1 - DECAY) * seconds


class CompositeDrafter(DrafterGroup):
    """Members asked per step (module docstring); each row verifies the proposal it expects most of."""

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
        if records is not None and len(records) != len(drafters):
            raise ValueError(f"a composite of {len(drafters)} drafters takes {len(drafters)} records, "
                             f"got {len(records)}")
        self.records = [MemberRecord() for _ in drafters] if records is None else records
        self.verify_s = [0.0] * len(drafters)  # per member: decayed seconds of verifying its proposals (0: none)
        self.chosen: list[int] = []  # per row: the member whose proposal was verified last step (-1: none)
        self.expected: list[float] = []  # per row: what that proposal was expected to get accepted (calibrated)
        self.raw: list[float] = []  # per row: the same, before calibration
        self.target_s = 0.0  # decayed seconds from the end of one propose to the next (verification)
        self.plain_s = 0.0  # the same, of steps that verified no proposal
        self._end = 0.0

    def max_nodes(self, k: int) -> int:
        return max(d.max_nodes(k) for d in self.drafters)

    def draft_cost(self, k: int) -> float:
        return max(d.draft_cost(k) for d in self.drafters if d.adaptive) if self.adaptive else 0.0

    def begin(self, prompts: list[torch.Tensor], max_len: int, hidden: torch.Tensor | None) -> None:
        super().begin(prompts, max_len, hidden)
        self._end = self.target_s = self.plain_s = 0.0
        self.verify_s = [0.0] * len(self.drafters)

    @staticmethod
    def _estimate(tree: DraftTree, b: int) -> float:
        """A member's raw estimate of the accepted length of row b's proposal in `tree`."""
        n = int(tree.lens[b])
        if not n:
            return 0.0
        return float(tree.scores[b, :n].sum()) if tree.scores is not None else float(n)

    def propose(self, seqs: list[torch.Tensor], k: int, rows: list[int]) -> DraftTree:
        start = time.perf_counter()
        if self._end:  # the last step's verification, charged to the members whose proposals it verified
            took = start - self._end
            self.target_s = _decayed(self.target_s, took)
            chosen = {c for c in self.chosen if c >= 0}
            for c in chosen:
                self.verify_s[c] = _decayed(self.verify_s[c], took)
            if not chosen:
                self.plain_s = _decayed(self.plain_s, took)
        B = len(seqs)
        verify_s = self.target_s or 1.0
        best_rate = {b: 1.0 / (self.plain_s or verify_s) for b in rows}  # a plain step: one token per verification
        trees: dict[int, DraftTree] = {}
        raw = torch.zeros(len(self.drafters), B)  # (M, B)
        expected = torch.full((len(self.drafters), B), -1.0)  # (M, B): -1 = not asked
        for i in sorted(range(len(self.drafters)), key=lambda i: self.drafters[i].draft_cost(k)):
            d, record = self.drafters[i], self.records[i]
            cost = d.draft_cost(k)
            # a member's proposals have their own verification cost (a draft model's chain of k: k + 1 rows)
            member_s = self.verify_s[i] or verify_s
            hoped = (1 + record.per_step) / (member_s + cost)
            ask = [b for b in rows if cost == 0 or hoped > best_rate[b]]
            if not ask:
                continue
            tree = trees[i] = d.propose(seqs, k, ask)
            for b in ask:
                raw[i, b] = self._estimate(tree, b)
                expected[i, b] = raw[i, b] * record.calibration()
                best_rate[b] = max(best_rate[b], (1 + float(expected[i, b])) / (member_s + cost))
        chosen = expected.argmax(0)  # (B,): ties go to the first member
        self.chosen = [int(chosen[b]) if b in rows and int(trees[int(chosen[b])].lens[b]) else -1
                       for b in range(B)]
        self.expected = [float(expected[c, b]) if c >= 0 else 0.0 for b, c in enumerate(self.chosen)]
        self.raw = [float(raw[c, b]) if c >= 0 else 0.0 for b, c in enumerate(self.chosen)]
        tree = self._combine(trees, B)
        self._end = time.perf_counter()
        return tree

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
        for i, d in enumerate(self.drafters):  # each member told which rows verified its proposal
            d.commit(dataclasses.replace(accepted, verified=[c == i for c in self.chosen]))
        for b, c in enumerate(self.chosen):
            if c >= 0:
                self.records[c].observe(self.raw[b], len(accepted.paths[b]))

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
