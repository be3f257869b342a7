"""specdec.evaluation.bench: weight bytes per token, bandwidth probes, a tiny benchmark run and its table."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest
import torch
from test_evaluate import tiny_checkpoint

from runtime import load_model
from runtime.output_paths import OutputPathError
from runtime.tiny import tiny_model
from specdec.evaluation import bench
from specdec.evaluation.bench import (
    BenchConfig,
    format_table,
    matvec_bandwidth,
    run_bench,
    stream_bandwidth,
    weight_bytes_per_token,
)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_bytes_per_token(tied, dtype):
    model = tiny_model(tie_word_embeddings=tied, dtype=dtype)
    C, F, V, L, D = 64, 96, 128, 2, 16  # hidden, intermediate, vocab, layers, head dim (4 q, 2 kv heads)
    per_layer = C * (4 + 2 + 2) * D + 4 * D * C + 2 * F * C + F * C + 2 * C  # qkv, o, gate|up, down, norms
    params = L * per_layer + C + V * C  # + final norm + lm_head (a tied lm_head counts once)
    assert weight_bytes_per_token(model) == params * dtype.itemsize


def test_bandwidth_probes_are_positive_and_finite():
    for bw in (matvec_bandwidth(256, torch.bfloat16, repeats=3), stream_bandwidth(4, repeats=3)):
        assert 1e6 < bw < 1e13


def test_config_validation_and_cli_defaults():
    for bad in (dict(prompts=0), dict(prompts=165), dict(dtype="int8"), dict(stream_mib=0), dict(warmup=-1),
                dict(threads=0)):
        with pytest.raises(ValueError):
            BenchConfig(**bad)
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    help_text = bench.register(sub).format_help()
    args = parser.parse_args(["bench"])
    for f in dataclasses.fields(BenchConfig):
        assert getattr(args, f.name) == f.default, f.name
        assert "--" + f.name.replace("_", "-") in help_text, f.name


def test_tiny_bench_run_and_table(tmp_path):
    ckpt = tiny_checkpoint(tmp_path / "ckpt")
    cfg = BenchConfig(model=str(ckpt), dtype="float32", prompts=2, max_new_tokens=8, warmup=1, matvec_size=256,
                      stream_mib=4, repeats=3, compile=True, json=str(tmp_path / "bench.json"))
    result = run_bench(cfg, progress=False)
    assert json.loads((tmp_path / "bench.json").read_text()) == json.loads(json.dumps(result))
    ours, theirs = result["runtimes"]["specdec"], result["runtimes"]["transformers"]
    assert ours["new_tokens"] == theirs["new_tokens"] == 2 * 8  # eos ignored: exactly max_new_tokens
    assert result["outputs_match"] == 1.0  # float32 greedy: same tokens as transformers
    assert result["outputs_match_by_runtime"] == {"specdec": 1.0, "transformers": 1.0, "specdec-compiled": 1.0}
    assert result["runtimes"]["specdec-compiled"]["new_tokens"] == 2 * 8
    assert result["weight_bytes_per_token"] == weight_bytes_per_token(load_model(ckpt, dtype=torch.float32))
    for name, ceiling in result["ceiling_tokens_per_second"].items():
        assert ceiling == pytest.approx(result["bandwidth_bytes_per_s"][name] / result["weight_bytes_per_token"])
        assert ours[f"fraction_of_{name}_ceiling"] == pytest.approx(ours["tokens_per_second"] / ceiling)
    assert result["speedup_vs_transformers"] == pytest.approx(ours["tokens_per_second"] / theirs["tokens_per_second"])
    table = format_table(result)
    assert result["command"].startswith("specdec bench --model") and f"`{result['command']}`" in table
    assert "| specdec (this runtime) |" in table and "| transformers generate() |" in table
    assert "`--compile`" in table
    assert "matvec ceiling" in table and "stream ceiling" in table


def test_json_never_replaces_a_file_bench_did_not_write(tmp_path):
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": 1}')
    missing = str(tmp_path / "no-such-model")  # the output is checked before the model is looked for
    with pytest.raises(OutputPathError, match="notes.json exists and is not a bench result JSON written by specdec"):
        run_bench(BenchConfig(model=missing, json=str(notes)), progress=False)
    with pytest.raises(OutputPathError, match=r"^/dev/null/b.json cannot be created .*/dev/null is not a directory"):
        run_bench(BenchConfig(model=missing, json="/dev/null/b.json"), progress=False)
    assert notes.read_text() == '{"mine": 1}' and sorted(p.name for p in tmp_path.iterdir()) == ["notes.json"]
