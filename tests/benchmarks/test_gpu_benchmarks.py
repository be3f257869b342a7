"""benchmarks/speculative_rounds.py and benchmarks/distill_step_time.py: without CUDA they refuse
with a message, and their --smoke runs (tiny configs on the CPU) time every method and write JSON."""

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
needs_cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU checks of the GPU scripts")


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs_cpu_only
@pytest.mark.parametrize("name", ["speculative_rounds", "distill_step_time"])
def test_gpu_scripts_refuse_without_cuda(name):
    with pytest.raises(SystemExit, match="CUDA machine, or with --smoke"):
        load(name).main([])


@needs_cpu_only
def test_speculative_rounds_smoke_times_every_method(tmp_path):
    out = tmp_path / "rounds.json"
    load("speculative_rounds").main(["--smoke", "--trees", "2x2/3", "--draft-tokens", "2", "--prompt-len", "8",
                                     "--new-tokens", "4", "--repeats", "1", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["method"] for r in rows] == ["plain", "eagle 2x2/3", "draft k2", "transformers generate()"]
    hf_ms = rows[-1]["round_ms"]
    for r in rows:
        assert r["round_ms"] > 0 and math.isclose(r["tau_for_4x_transformers"], 4 * r["round_ms"] / hf_ms)
    assert rows[0]["vs_plain_step"] == 1.0


@needs_cpu_only
def test_distill_step_time_smoke_runs_the_real_loop(tmp_path):
    out = tmp_path / "steps.json"
    load("distill_step_time").main(["--smoke", "--steps", "1", "--batch-size", "2", "--max-new-tokens", "4",
                                    "--prompt-len", "6", "--json", str(out)])
    figures = json.loads(out.read_text())
    assert figures["seconds_per_step"] > 0 and figures["steps"] == 1 and figures["target"] == "tiny"
