"""`specdec compress` (quant.command) and YAML recipes on a tiny checkpoint directory."""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import runtime
from quant.command import register
from quant.recipe import load_recipe
from runtime.outputs import OutputPathError
from runtime.qlinear import Int8Linear, Sparse24Linear
from runtime.tiny import tiny_pair
from tests.quant.conftest import TEXTS

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def tiny_dir(tmp_path, tokenizer):
    _, hf = tiny_pair("llama", seed=0, vocab_size=300)
    hf.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    return tmp_path / "tiny"


def _parse(argv):
    parser = argparse.ArgumentParser(prog="specdec")
    register(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_compress_applies_the_recipe_and_writes_a_loadable_checkpoint(tiny_dir, tmp_path, capsys):
    calib = tmp_path / "calib.jsonl"
    calib.write_text("\n".join(json.dumps({"text": t}) for t in TEXTS))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"calibration: {{source: {calib}, n_samples: 4, seq_len: 32}}\n"
                      "steps:\n  - {type: SemiStructured24, method: sparsegpt, modules: ['*.mlp.*']}\n"
                      "  - {type: Int8WeightOnly, modules: ['*.attn.*']}\n")
    args = _parse(["compress", "--model", str(tiny_dir), "--recipe", str(recipe), "--out", str(tmp_path / "out"),
                   "--eval-samples", "0", "--dtype", "float32", "--export-dense"])
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert "weights in memory (MiB)" in printed and "time (s)" in printed
    model = runtime.load_model(tmp_path / "out", dtype=torch.float32, weights="dense")
    assert isinstance(model.layers[0].mlp.w13, Sparse24Linear) and isinstance(model.layers[1].attn.wo, Int8Linear)
    assert [s["type"] for s in model.compression_recipe] == ["SemiStructured24", "Int8WeightOnly"]
    assert (tmp_path / "out-dense" / "model.safetensors").is_file()


def test_recipe_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("- {type: Int4WeightOnly, group_size: 100}\n")
    with pytest.raises(ValueError, match="bad.yaml: Int4WeightOnly.group_size"):
        load_recipe(bad)
    bad.write_text("steps: 3\n")
    with pytest.raises(ValueError, match="list of configs"):
        load_recipe(bad)
    bad.write_text("calibration: {samples: 3}\nsteps: [{type: NF4}]\n")
    with pytest.raises(ValueError, match="unknown calibration keys"):
        load_recipe(bad)
    with pytest.raises(FileNotFoundError):
        load_recipe(tmp_path / "missing.yaml")
    plain = tmp_path / "plain.yaml"
    plain.write_text("- {type: Int8WeightOnly}\n")
    assert not load_recipe(plain).needs_calibration
    per_text = tmp_path / "per_text.yaml"
    per_text.write_text("calibration: {n_samples: 8, one_per_text: true}\nsteps: [{type: NF4}]\n")
    assert load_recipe(per_text).calibration["one_per_text"] is True


def _snapshot(root) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _cli(*argv: str, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "SPECDEC_DEBUG": ""}
    return subprocess.run([sys.executable, "-m", "specdec.cli", *argv], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=300)


def test_compress_refuses_bad_output_paths_before_any_work(tmp_path):
    """A file, or a directory specdec did not write (even with --overwrite), fails with one line and
    exit status 2 before the model is loaded (it does not exist here); nothing is touched."""
    (tmp_path / "file").write_text("mine")
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "notes.txt").write_text("keep me")
    before = _snapshot(tmp_path)
    base = ["compress", "--model", str(tmp_path / "no-such-model"), "--recipe", str(tmp_path / "r.yaml")]
    for out, extra, message in [("file", [], "file exists and is not a directory"),
                                ("home", ["--overwrite"], "home is a non-empty directory that specdec did not write")]:
        proc = _cli(*base, "--out", str(tmp_path / out), *extra, cwd=ROOT)
        assert proc.returncode == 2, proc.stderr
        first = proc.stderr.splitlines()[0]
        assert first.startswith("specdec compress: error: ") and message in first, proc.stderr
        assert "Traceback" not in proc.stderr
    assert _snapshot(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["file", "home"]


def test_compress_needs_overwrite_to_replace_its_own_checkpoint(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "compression.json").write_text("{}")
    args = _parse(["compress", "--model", str(tmp_path / "no-such-model"), "--recipe", str(tmp_path / "r.yaml"),
                   "--out", str(tmp_path / "out")])
    with pytest.raises(OutputPathError, match="already holds a compressed checkpoint.*--overwrite"):
        args.func(args)
    (tmp_path / "out-dense").mkdir()
    (tmp_path / "out-dense" / "weights.bin").write_text("mine")
    args = _parse(["compress", "--model", str(tmp_path / "no-such-model"), "--recipe", str(tmp_path / "r.yaml"),
                   "--out", str(tmp_path / "out"), "--export-dense", "--overwrite"])
    with pytest.raises(OutputPathError, match="out-dense is a non-empty directory"):
        args.func(args)
