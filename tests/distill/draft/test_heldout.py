"""distill.draft.heldout on tiny random models: teacher-forced agreement against a row-by-row count,
expected tau by hand, the held-out set's file, and its use inside distill_draft."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from distill.draft.heldout import HeldoutSet, agreement, expected_tau, target_answers
from distill.draft.train import DistillConfig, distill_draft
from runtime.tiny import tiny_model

FAST = dict(lr=3e-3, max_new_tokens=12, mixed_precision="no", eval_tokens=12, warmup_steps=2)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (int(torch.randint(2, 9, (), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]


def _count_by_hand(draft, held: HeldoutSet) -> tuple[int, float, int]:
    """Top-1 hits and summed cross-entropy of `draft` on the answers, one unpadded row at a time."""
    hits, nll, count = 0, 0.0, 0
    for p, a in zip(held.prompts, held.answers):
        if not a:
            continue
        ids = torch.tensor([p + a])
        with torch.no_grad():
            logits = draft(ids, torch.arange(ids.shape[1])[None], None).logits[0, len(p) - 1:-1]  # (len(a), V)
        hits += int((logits.argmax(-1) == torch.tensor(a)).sum())
        nll += float(torch.nn.functional.cross_entropy(logits, torch.tensor(a), reduction="sum"))
        count += len(a)
    return hits, nll, count


def test_agreement_counts_every_answer_position_like_a_row_by_row_forward():
    target, draft = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    held = target_answers(target, _prompts(7), 10)
    assert all(len(a) == 10 for a in held.answers)
    held = HeldoutSet(held.prompts, held.answers[:-1] + [[]])  # a row without an answer scores nothing
    got = agreement(draft, held, k=3, rows_per_forward=3)  # padded rows of different lengths
    hits, nll, count = _count_by_hand(draft, held)
    assert got["positions"] == count == 60
    assert got["agreement"] == pytest.approx(hits / count)
    assert got["ce"] == pytest.approx(nll / count, rel=1e-5)
    assert got["expected_tau"] == pytest.approx(expected_tau(hits / count, 3))


def test_the_target_agrees_with_its_own_greedy_answers():
    target = tiny_model("llama", seed=0)
    held = target_answers(target, _prompts(5, seed=4), 12)
    got = agreement(copy.deepcopy(target), held, k=4)
    assert got["agreement"] == 1.0 and got["expected_tau"] == 5.0


def test_expected_tau_by_hand():
    assert expected_tau(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tau(0.0, 5) == 1.0
    assert expected_tau(0.8, 1) == pytest.approx(1.8)
    with pytest.raises(ValueError, match="k"):
        expected_tau(0.5, 0)


def test_heldout_set_round_trips_and_refuses_bad_input(tmp_path):
    held = HeldoutSet([[1, 2], [3]], [[4, 5], [6]])
    held.save(tmp_path / "h.json")
    assert HeldoutSet.load(tmp_path / "h.json") == held
    with pytest.raises(ValueError, match="one answer per prompt"):
        HeldoutSet([[1]], [[2], [3]])
    with pytest.raises(ValueError, match="every held-out answer is empty"):
        HeldoutSet([[1]], [[]])


def test_distillation_raises_the_heldout_agreement_and_keeps_the_answers(tmp_path):
    target, draft = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    held = _prompts(4, seed=2)
    cfg = DistillConfig(steps=15, eval_every=5, eval_decode=False, **FAST)
    distill_draft(target, draft, _prompts(24, seed=1), cfg, tmp_path / "out", heldout=held)
    metrics = json.loads((tmp_path / "out" / "distill_metrics.json").read_text())
    evals = metrics["heldout"]
    assert [e["step"] for e in evals] == [0, 5, 10, 15]
    assert not any("tau" in e for e in evals)  # no speculative decoding without eval_decode
    assert evals[-1]["agreement"] > evals[0]["agreement"] and evals[-1]["ce"] < evals[0]["ce"]
    saved = HeldoutSet.load(tmp_path / "out" / "heldout_answers.json")
    assert saved.prompts == held and saved == target_answers(target, held, cfg.eval_tokens)
