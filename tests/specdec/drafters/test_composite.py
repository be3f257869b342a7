"""The composite drafter (`A|B`): lossless with any members, each row verifies the proposal worth
most per second, a costly member runs where its gate measured that running it paid, and calibration
follows acceptance."""

import time

import pytest
import torch

import specdec
from specdec.drafter import Accepted, Drafter, DraftTree
from specdec.drafters import CompositeDrafter
from specdec.drafters.suffix import SuffixCache, SuffixConfig, SuffixDrafter
from specdec.loader import make_drafter
from specdec.methods import DrafterSpec
from specdec.tuning.gates import EXPLORE, GATE_EDGES, ROWS, START_EXPLORE, AskGate, MemberRecord
from specdec.tuning.state import process_state
from tests.specdec.test_decode import _rows, _same, assert_two_token_law


class Fixed(Drafter):
    """Proposes `tokens` as a chain with per-node scores `scores` to every asked row; counts calls."""

    def __init__(self, name: str, tokens: list[int], scores: list[float] | None, cost: float = 0.0,
                 adaptive: bool = False) -> None:
        self.name, self.tokens, self.scores, self.cost, self.adaptive = name, tokens, scores, cost, adaptive
        self.runs_model = cost > 0
        self.asked: list[list[int]] = []
        self.verified: list[list[bool] | None] = []  # what each commit told it

    def commit(self, accepted):
        self.verified.append(accepted.verified)

    def propose(self, seqs, k, rows):
        self.asked.append(list(rows))
        B, n = len(seqs), len(self.tokens)
        tokens = torch.tensor(self.tokens).repeat(B, 1)
        lens = torch.zeros(B, dtype=torch.long)
        lens[rows] = n
        scores = None if self.scores is None else torch.tensor(self.scores).repeat(B, 1)
        return DraftTree.chain(tokens, lens, scores=scores)

    def draft_cost(self, k):
        return self.cost


def _suffix():
    return SuffixDrafter(SuffixConfig(), cache=SuffixCache(4096))


@pytest.mark.parametrize("k", [3, "auto"])
def test_greedy_output_equals_plain_with_every_kind_of_member(target, random_draft, k):
    rows = _rows(seed=9, lengths=(3, 12, 6, 2))
    plain = specdec.generate(target, rows, max_new_tokens=30).sequences
    for members in ([_suffix(), make_drafter(random_draft, target)], [make_drafter("ngram", target), _suffix(),
                                                                      make_drafter(target, target)]):
        out = specdec.generate(target, rows, draft=CompositeDrafter(members), max_new_tokens=30, num_draft_tokens=k)
        assert _same(out.sequences, plain)


def test_sampling_keeps_the_joint_law_of_two_tokens(target, random_draft):
    n = 3000
    prompt = torch.stack([torch.arange(64), (torch.arange(64) * 7 + 3) % 64], dim=1).flatten()
    kw = dict(temperature=0.8, top_k=12, top_p=0.9)
    suffix = SuffixDrafter(SuffixConfig(depth=4, max_nodes=2, max_factor=4.0), cache=SuffixCache(4096, 4))
    comp = CompositeDrafter([suffix, make_drafter(random_draft, target, generator=torch.Generator().manual_seed(3),
                                                  **kw)])
    out = specdec.generate(target, [prompt] * n, draft=comp, max_new_tokens=3, num_draft_tokens=2,
                           generator=torch.Generator().manual_seed(4), **kw)
    assert out.stats.drafted_tokens >= n
    assert_two_token_law(target, prompt, out.sequences, kw)


def _step(comp: CompositeDrafter, accepted: list[int]) -> DraftTree:
    """One propose of 2 rows and a commit accepting accepted[b] nodes of row b."""
    seqs = [torch.tensor([1, 2, 3])] * 2
    tree = comp.propose(seqs, 4, [0, 1])
    comp.commit(Accepted(seqs, [list(range(min(a, int(tree.lens[b])))) for b, a in enumerate(accepted)]))
    return tree


def test_every_verification_is_numbered_once_for_the_tuner_and_the_drafter(target, monkeypatch):
    """The decode loop numbers each verification (`Accepted.step`) and tells the draft-length tuner the
    same number, so a cost store both feed (a composite's suffix member and an `@auto` draft) records
    each verification once."""
    from specdec.tuning.autok import AutoK

    tuner_steps: list[int] = []
    time_block = AutoK.time_block
    monkeypatch.setattr(AutoK, "time_block", lambda self, block, seconds, step=0: (
        tuner_steps.append(step), time_block(self, block, seconds, step))[1])
    drafter_steps: list[int] = []

    class Numbered(Fixed):
        def commit(self, accepted):
            drafter_steps.append(accepted.step)

    rows = _rows(seed=4, lengths=(5,))
    specdec.generate(target, rows, draft=Numbered("a", [1], None, adaptive=True), max_new_tokens=12,
                     num_draft_tokens="auto")
    assert drafter_steps and tuner_steps == drafter_steps
    assert all(a < b for a, b in zip(drafter_steps, drafter_steps[1:])) and drafter_steps[0] > 0


def test_each_row_verifies_the_proposal_with_the_most_expected_tokens():
    long = Fixed("long", [5, 6, 7, 8], [0.9, 0.3, 0.1, 0.05])  # expects 1.35
    sure = Fixed("sure", [9, 10], [0.95, 0.9])  # expects 1.85
    comp = CompositeDrafter([long, sure])
    tree = _step(comp, [2, 2])
    assert tree.tokens[:, :2].tolist() == [[9, 10], [9, 10]] and tree.lens.tolist() == [2, 2]
    assert comp.chosen == [1, 1] and tree.scores[0, :2].tolist() == pytest.approx([0.95, 0.9])
    assert tree.sized_by_k.tolist() == [False, False]  # fixed-size members: auto learns nothing from them


def test_each_member_is_told_which_rows_verified_its_proposal():
    long = Fixed("long", [5, 6, 7, 8], [0.9, 0.3, 0.1, 0.05])
    sure = Fixed("sure", [9, 10], [0.95, 0.9])
    comp = CompositeDrafter([long, sure])
    seqs = [torch.tensor([1, 2])] * 2
    comp.propose(seqs, 4, [0])  # row 1 is not asked: no member's proposal is verified there
    comp.commit(Accepted(seqs, [[0], []]))
    assert comp.chosen == [1, -1] and long.verified == [[False, False]] and sure.verified == [[True, False]]


def test_calibration_turns_away_from_a_member_whose_drafts_are_rejected():
    bold = Fixed("bold", [5, 6, 7], [0.9, 0.9, 0.9])  # claims 2.7 tokens; none is ever accepted
    modest = Fixed("modest", [9], None)  # no estimate (its one draft); always accepted
    comp = CompositeDrafter([bold, modest])
    seqs = [torch.tensor([1, 2, 3])] * 2
    picks = []
    for _ in range(12):
        comp.propose(seqs, 4, [0, 1])
        picks.append(comp.chosen[0])
        comp.commit(Accepted(seqs, [[] if c == 0 else [0] for c in comp.chosen]))
    assert picks[0] == 0 and picks[-1] == 1 and comp.records[0].calibration() < 0.4


def test_with_measured_block_costs_each_row_verifies_the_proposal_worth_most_per_second():
    long = Fixed("long", [5, 6, 7, 8], [0.9, 0.9, 0.9, 0.9])  # expects 3.6 tokens, in a 5-row block
    short = Fixed("short", [9], [0.95])  # expects 0.95, in a 2-row block
    comp = CompositeDrafter([long, short])
    seqs = [torch.tensor([1, 2, 3])]
    comp.propose(seqs, 4, [0])
    assert comp.chosen == [0]  # no block timed yet: the most expected tokens
    for block, seconds in ((2, 0.05), (5, 0.2)):
        comp.commit(Accepted(seqs, [[]], block=block, target_s=seconds))
    comp.propose(seqs, 4, [0])
    assert comp.chosen == [1]  # 1.95 tokens / 0.05 s beats 4.6 / 0.2 s


class Slow(Fixed):
    """A Fixed member whose propose takes `cost` seconds."""

    def propose(self, seqs, k, rows):
        time.sleep(self.cost)
        return super().propose(seqs, k, rows)


def test_a_costly_member_runs_where_its_gate_measured_that_running_it_paid():
    cheap = Fixed("cheap", [5, 6], [0.5, 0.3])
    costly = Fixed("costly", [9, 10, 11, 12], [0.9, 0.8, 0.7, 0.6], cost=0.05, adaptive=True)
    seqs = [torch.tensor([1, 2])] * 2
    for ran_rate, runs in ((1.0, False), (5.0, True)):
        records = [MemberRecord(), MemberRecord()]
        for gain in range(len(GATE_EDGES) + 1):  # whatever the best proposal in hand
            records[0].gate.observe(gain, True, ran_rate, 1.0)  # tokens per second of steps that ran it
            records[0].gate.observe(gain, False, 3.0, 1.0)  # and of those that did not
        comp = CompositeDrafter([costly, cheap], records)
        costly.asked.clear()
        for _ in range(2):
            comp.propose(seqs, 4, [0, 1])
            comp.commit(Accepted(seqs, [[0, 1, 2, 3] if c == 0 else [0, 1] for c in comp.chosen]))
        assert costly.asked == ([[0, 1]] * 2 if runs else [])
        assert comp.chosen == ([0, 0] if runs else [1, 1])
        assert [c.ran for c in comp.gated[0]] == [runs]  # where it ran, its first step started it: no gate's


def test_a_gate_is_charged_the_step_its_choice_took_and_explores_the_other_choice():
    costly = Slow("costly", [9, 10], [0.9, 0.8], cost=0.05, adaptive=True)
    comp = CompositeDrafter([Fixed("cheap", [5], [0.2]), costly])
    seqs = [torch.tensor([1, 2])]
    for _ in range(2):  # the first step is ungated; the second runs costly: never measured running
        comp.propose(seqs, 4, [0])
        comp.commit(Accepted(seqs, [[0, 1]]))
    (choice,) = comp.gated[0]
    assert choice.ran
    comp.propose(seqs, 4, [0])
    gate = comp.records[1].gate
    assert gate.tokens[choice.bin][True] == 3 and 0.05 <= gate.seconds[choice.bin][True] < 1.0
    fresh = AskGate()
    fresh.observe(0, True, 1, 1.0)
    fresh.observe(0, False, 2, 1.0)
    picks = []
    for _ in range(2 * EXPLORE + 1):
        picks.append(fresh.ask(0))
        fresh.observe(0, picks[-1], 2 if not picks[-1] else 1, 1.0)
    # the slower choice, once it has not been taken for EXPLORE steps (one step counted before the loop)
    assert [i for i, ran in enumerate(picks) if ran] == [EXPLORE - 1, 2 * EXPLORE]


def test_a_member_starts_on_rows_as_the_rows_with_it_decoded_faster_than_without():
    record = MemberRecord()

    def row(started: bool, rate: float) -> None:  # a finished row of 10 tokens at `rate` tokens/s
        record.new_row(started)[:] = [10, 10 / rate]

    assert record.should_start()  # no row with it started yet
    row(True, 10.0)
    assert not record.should_start()  # nor declined
    row(False, 20.0)  # rows without it decode twice as fast
    picks = []
    for _ in range(2 * START_EXPLORE):
        picks.append(record.should_start())
        row(picks[-1], 10.0 if picks[-1] else 20.0)
    assert picks.count(True) == 2 and not picks[0]  # started once in START_EXPLORE rows, to stay measured
    for _ in range(ROWS - 1):
        row(True, 100.0)  # rows with it now decode much faster
    row(True, 0.01)  # and one compiled a program: the median ignores it
    assert record.should_start()


def test_a_rows_start_up_is_no_gates_step_and_its_rate_teaches_the_start_choice():
    costly = Slow("costly", [9, 10], [0.9, 0.8], cost=0.05, adaptive=True)
    comp = CompositeDrafter([Fixed("cheap", [5], [0.2]), costly])
    seqs = [torch.tensor([1, 2])]
    comp.begin(seqs, 16, None)
    comp.propose(seqs, 4, [0])
    assert costly.asked == [[0]] and comp.gated == {}  # started on the row: no gate's step
    comp.commit(Accepted(seqs, [[0]]))
    record = comp.records[1]
    assert record.rows[True][-1][0] == 2 and record.rows[True][-1][1] >= 0.05
    comp.begin(seqs, 16, None)  # the next call
    comp.propose(seqs, 4, [0])  # rows without it not measured yet: declined on this one
    assert costly.asked == [[0]] and [c.ran for c in comp.gated[0]] == [False]
    comp.commit(Accepted(seqs, [[0]]))
    assert record.row_rate(False) > record.row_rate(True)


def test_the_spec_builds_a_composite_with_generates_sampling(target):
    comp = make_drafter("suffix|ngram", target)
    assert isinstance(comp, CompositeDrafter) and comp.name == "suffix|ngram" and comp.adaptive  # ngram drafts k
    spec = DrafterSpec.parse("ngram|draft:x@auto:p0.4")
    assert spec.kind == "composite" and spec.draft_length == "auto" and spec.members[1].p_min == 0.4
    with pytest.raises(ValueError, match="two or more"):
        CompositeDrafter([_suffix()])


def test_a_composite_starts_from_the_records_it_is_given():
    bold = Fixed("bold", [5, 6, 7], [0.9, 0.9, 0.9])
    modest = Fixed("modest", [9], None)
    records = [MemberRecord(), MemberRecord()]
    first = CompositeDrafter([bold, modest], records)
    seqs = [torch.tensor([1, 2, 3])] * 2
    for _ in range(12):  # bold's drafts are all rejected
        first.propose(seqs, 4, [0, 1])
        first.commit(Accepted(seqs, [[] if c == 0 else [0] for c in first.chosen]))
    fresh, taught = CompositeDrafter([bold, modest]), CompositeDrafter([bold, modest], records)
    for comp in (fresh, taught):
        comp.begin(seqs, 16, None)
        comp.propose(seqs, 4, [0, 1])
    assert fresh.chosen == [0, 0] and taught.chosen == [1, 1]  # the taught one no longer trusts bold
    with pytest.raises(ValueError, match="takes 2 records, got 1"):
        CompositeDrafter([bold, modest], [MemberRecord()])


def test_a_spec_composite_keeps_its_records_across_generate_calls(target):
    rows = _rows(seed=5, lengths=(9, 14))
    records = process_state().composite_records("ngram|suffix", 2)
    steps = [r.steps for r in records]
    for _ in range(2):
        specdec.generate(target, rows, draft="ngram|suffix", max_new_tokens=12, num_draft_tokens=3)
        assert sum(r.steps for r in records) > sum(steps)  # the call's drafter updated the process's records
        steps = [r.steps for r in records]
    assert make_drafter("ngram|suffix", target).records is records
    with pytest.raises(ValueError, match="has 3 members but its records hold 2"):
        process_state().composite_records("ngram|suffix", 3)
