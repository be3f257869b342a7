"""benchmarks/bench_attention.py: refuses to run without CUDA, and its --smoke run (interpreter) works."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_attention.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_attention", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_triton_bench_needs_cuda(bench):
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bench.main(["--parts", "prefill"])


def test_triton_bench_smoke_writes_tables_and_json(bench, tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("the --smoke run is the CPU check of the script")
    out = tmp_path / "bench.json"
    bench.main(["--smoke", "--parts", "verify,decode", "--shape", "0.5b", "--verify-queries", "3",
                "--cache-lens", "21", "--decode-len", "40", "--decode-batches", "1", "--json", str(out)])
    printed = capsys.readouterr().out
    assert "### verify" in printed and "### decode" in printed
    results = json.loads(out.read_text())["results"]
    assert [r["queries"] for r in results["verify"]] == [3]
    assert results["verify"][0]["max_abs_diff"] < 0.05  # bf16 kernel vs SDPA on the same tree mask
    assert results["decode"][0]["max_abs_diff"] < 0.05
