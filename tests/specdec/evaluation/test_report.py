"""specdec.evaluation.report: metrics from generation lines (medians, speedups, matches, acceptance), files."""

from __future__ import annotations

import json

import pytest

from specdec.evaluation.report import build_report, render_markdown, write_report
from specdec.stats import AcceptanceStats


def _stats(forwards: int, generated: int, drafted: list[int], accepted: list[int]) -> dict:
    s = AcceptanceStats(target_forwards=forwards, generated_tokens=generated, drafted_tokens=sum(drafted),
                        accepted_tokens=sum(accepted), num_calls=1)
    s.record_positions(drafted, accepted)
    return s.to_dict()


def _line(pid, cat, method, tps, ids, stats=None):
    return {"id": pid, "category": cat, "method": method, "turns": ["q"], "outputs": ["o"], "output_ids": [ids],
            "new_tokens": len(ids), "wall_s": len(ids) / tps, "tokens_per_second": tps, "stats": stats}


def _records():
    plain = _stats(3, 3, [], [])
    return [
        _line("a", "code", "plain", 10.0, [1, 2, 3], plain),
        _line("a", "code", "ngram", 30.0, [1, 2, 3], _stats(2, 3, [2, 1], [1, 1])),
        _line("a", "code", "hf", 5.0, [1, 2, 3]),
        _line("b", "chat", "plain", 20.0, [4, 5, 6], plain),
        _line("b", "chat", "ngram", 40.0, [4, 5, 7], _stats(3, 3, [2, 0], [0, 0])),
        _line("b", "chat", "hf", 8.0, [4, 5, 6]),
        _line("c", "code", "plain", 12.0, [7, 8, 9], plain),
        _line("c", "code", "ngram", 36.0, [7, 8, 9], _stats(1, 3, [2, 2], [2, 1])),
        _line("c", "code", "hf", 6.0, [7, 8, 9]),
        _line("z", "code", "ngram", 999.0, [1], None),  # not in this run's prompts: ignored
    ]


def test_overall_and_category_metrics():
    r = build_report(_records(), {"target": "t", "num_draft_tokens": 2}, ["plain", "ngram", "hf"],
                     ["a", "b", "c"], command="specdec eval ...", versions={"torch": "x"})
    ng, plain, hf = (r["methods"][m] for m in ("ngram", "plain", "hf"))
    o = ng["overall"]
    assert o["num_prompts"] == 3 and o["new_tokens"] == 9
    assert o["tokens_per_second"] == 36.0  # median of 30, 40, 36
    assert o["speedup_vs_plain"] == pytest.approx(36.0 / 12.0)
    assert o["speedup_vs_hf"] == pytest.approx(36.0 / 6.0)
    assert o["matches_plain"] == pytest.approx(2 / 3)
    assert o["paired_vs_first"] == pytest.approx((3.0 * 2.0 * 3.0) ** (1 / 3))  # per prompt 30/10, 40/20, 36/12
    assert plain["overall"]["paired_vs_first"] == pytest.approx(1.0)
    assert ng["categories"]["chat"]["paired_vs_first"] == pytest.approx(2.0)
    assert o["tau"] == pytest.approx(9 / 6)  # 9 tokens over 6 target forwards
    assert o["acceptance_rate"] == pytest.approx(5 / 9)
    assert o["per_position_acceptance"] == pytest.approx([3 / 6, 2 / 3])
    assert o["stats"]["drafted_tokens"] == 9 and "bonus" in o["stats"]["tau_convention"]
    code = ng["categories"]["code"]
    assert code["num_prompts"] == 2 and code["tokens_per_second"] == 33.0 and code["matches_plain"] == 1.0
    assert code["speedup_vs_plain"] == pytest.approx(33.0 / 11.0)
    assert ng["categories"]["chat"]["matches_plain"] == 0.0
    assert plain["overall"]["tau"] == 1.0 and plain["overall"]["acceptance_rate"] is None
    assert plain["overall"]["speedup_vs_plain"] == 1.0
    assert hf["overall"]["tau"] is None and hf["overall"]["per_position_acceptance"] is None
    assert hf["overall"]["matches_plain"] == 1.0
    assert r["settings"]["k"] == 2 and r["settings"]["num_prompts"] == 3 and "bonus" in r["tau_convention"]


def test_without_plain_comparisons_are_null():
    r = build_report(_records(), {"num_draft_tokens": 2}, ["ngram"], ["a", "b"], command="c", versions={})
    o = r["methods"]["ngram"]["overall"]
    assert o["speedup_vs_plain"] is None and o["matches_plain"] is None
    assert o["paired_vs_first"] == 1.0  # the first method is itself
    assert not any(k.startswith("speedup_vs_hf") for k in o)


def test_markdown_and_files(tmp_path):
    settings = {"target": "tiny", "dtype": "float32", "device": "cpu", "dataset": "humaneval", "prompts": None,
                "prompt_format": "raw", "max_new_tokens": 3, "num_draft_tokens": 2, "temperature": 0.0}
    r = build_report(_records(), settings, ["plain", "ngram", "hf"], ["a", "b", "c"], command="specdec eval --x",
                     versions={"torch": "2"})
    md = render_markdown(r)
    assert "`specdec eval --x`" in md and "bonus" in md
    assert "| `ngram` | 3 | 1.50 | 0.56 | 36.0 | 3.00x | 6.00x | 2.62x | 0.67 |" in md and "vs `plain` (paired)" in md
    assert "### Category: chat" in md and "### Category: code" in md
    write_report(tmp_path, r)
    assert json.loads((tmp_path / "report.json").read_text())["methods"]["ngram"]["overall"]["tau"] == 1.5
    assert (tmp_path / "report.md").read_text() == md
    for png in ("acceptance.png", "speedup.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"
    assert not list(tmp_path.glob("*.tmp"))
