"""benchmarks/speculative_rounds.py and benchmarks/distill_step_time.py: without CUDA they refuse
with a message, and their --smoke runs (tiny configs on the CPU) time every method and write JSON."""

import json

import pytest
import torch

needs_cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU checks of the GPU scripts")


@needs_cpu_only
@pytest.mark.parametrize("name", ["speculative_rounds", "distill_step_time"])
def test_gpu_scripts_refuse_without_cuda(load, name):
    with pytest.raises(SystemExit, match="CUDA machine, or with --smoke"):
        load(name).main([])


def test_speculative_rounds_figures_are_medians_over_runs(load):
    row = load("speculative_rounds").figures("eagle", [0.030, 0.036, 0.033], [0.010, 0.012, 0.011],
                                             plain_s=0.022, hf_s=0.033)
    assert row["round_ms"] == pytest.approx(33.0) and row["draft_ms"] == pytest.approx(11.0)
    assert (row["min_ms"], row["max_ms"]) == (pytest.approx(30.0), pytest.approx(36.0))
    assert row["vs_plain_step"] == pytest.approx(1.5)
    assert row["tau_for_4x_transformers"] == pytest.approx(4.0)  # 4 x 33 ms / 33 ms a transformers token


@needs_cpu_only
def test_speculative_rounds_smoke_times_every_method(load, tmp_path):
    out = tmp_path / "rounds.json"
    load("speculative_rounds").main(["--smoke", "--trees", "2x2/3", "--draft-tokens", "2", "--prompt-len", "8",
                                     "--new-tokens", "4", "--repeats", "1", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["method"] for r in rows] == ["plain", "eagle 2x2/3", "draft k2", "transformers generate()"]
    assert all(r["round_ms"] > 0 for r in rows)
    assert rows[1]["draft_ms"] > 0 and rows[2]["draft_ms"] > 0 and rows[0]["draft_ms"] < rows[1]["draft_ms"]


@needs_cpu_only
def test_distill_step_time_smoke_runs_the_real_loop(load, tmp_path):
    out = tmp_path / "steps.json"
    load("distill_step_time").main(["--smoke", "--steps", "1", "--batch-size", "2", "--max-new-tokens", "4",
                                    "--prompt-len", "6", "--json", str(out)])
    figures = json.loads(out.read_text())
    assert figures["seconds_per_step"] > 0 and figures["steps"] == 1 and figures["target"] == "tiny"
