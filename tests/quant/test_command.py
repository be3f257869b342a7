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
from runtime.output_paths import OutputPathError
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
    with pytest.raises(ValueError, match="bad.yaml: step 1: Int4WeightOnly.group_size"):
        load_recipe(bad)
    bad.write_text("steps: 3\n")
    with pytest.raises(ValueError, match="list of configs"):
        load_recipe(bad)
    with pytest.raises(FileNotFoundError):
        load_recipe(tmp_path / "missing.yaml")
    plain = tmp_path / "plain.yaml"
    plain.write_text("- {type: Int8WeightOnly}\n")
    assert not load_recipe(plain).needs_calibration
    per_text = tmp_path / "per_text.yaml"
    per_text.write_text("calibration: {n_samples: 8, one_per_text: true}\nsteps: [{type: NF4}]\n")
    assert load_recipe(per_text).calibration["one_per_text"] is True


CALIBRATION_KEYS = "allowed: n_samples, one_per_text, seq_len, source"


@pytest.mark.parametrize("text, first", [
    ("calibraton: {n_samples: 4}\nsteps: [{type: NF4}]\n",
     "top level: unknown key 'calibraton' (did you mean 'calibration'?); allowed: calibration, steps"),
    ("calibration: {n_sample: 4, seqlen: 8, corpus: x}\nsteps: [{type: NF4}]\n",
     "calibration: unknown keys 'n_sample' (did you mean 'n_samples'?), 'seqlen' (did you mean 'seq_len'?), "
     f"'corpus'; {CALIBRATION_KEYS}"),
    ("- {type: Int8WeightOnly}\n- {type: Int4WeightOnly, grop_size: 64}\n",
     "step 2: Int4WeightOnly: unknown key 'grop_size' (did you mean 'group_size'?); allowed: act_order, block_size, "
     "damp, exclude, grid, group_size, include_lm_head, method, modules, type, zero_point"),
    ("- {type: Int4WeightOnl}\n", "step 1: unknown config type 'Int4WeightOnl' (did you mean 'Int4WeightOnly'?)"),
    ("- {type: Int4WeightOnly, group_size: '64'}\n", "step 1: Int4WeightOnly.group_size must be an integer, got '64'"),
    ("- {type: Int8WeightOnly, modules: '*.attn.*'}\n",
     "step 1: Int8WeightOnly.modules must be a list of fnmatch patterns (strings), got '*.attn.*'"),
    ("calibration: 3\nsteps: [{type: NF4}]\n", "calibration must be a mapping of source, n_samples, seq_len"),
    ("calibration: {n_samples: -1}\nsteps: [{type: NF4}]\n", "calibration.n_samples must be an integer >= 1, got -1"),
    ("calibration: {seq_len: 1}\nsteps: [{type: NF4}]\n", "calibration.seq_len must be an integer >= 2, got 1"),
    ("calibration: {one_per_text: 'yes'}\nsteps: [{type: NF4}]\n",
     "calibration.one_per_text must be true or false, got 'yes'"),
], ids=["top", "calibration", "step", "type", "value-type", "patterns", "calibration-type", "n_samples", "seq_len",
        "one_per_text"])
def test_recipe_keys_and_values_are_checked_at_every_level(tmp_path, text, first):
    """Unknown keys are refused by name with the closest allowed key, at the top, in calibration and
    in each step (they used to be ignored); values of the wrong type or range are refused too."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text)
    with pytest.raises(ValueError) as err:
        load_recipe(recipe)
    assert str(err.value).splitlines()[0].startswith(f"recipe {recipe}: {first}"), str(err.value)


def test_compress_refuses_unknown_recipe_keys_and_bad_counts_on_the_command_line(tmp_path):
    """specdec compress: one line, exit status 2, no traceback, before any model is loaded (none exists
    here) and nothing written."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("calibration: {n_samples: 4}\nsteps:\n  - {type: Int8WeightOnly, include_lmhead: true}\n")
    base = ["compress", "--model", str(tmp_path / "no-such-model"), "--recipe", str(recipe),
            "--out", str(tmp_path / "out")]
    for extra, first in [
            ([], f"specdec compress: error: recipe {recipe}: step 1: Int8WeightOnly: unknown key 'include_lmhead' "
                 "(did you mean 'include_lm_head'?); allowed: exclude, include_lm_head, modules, type"),
            (["--calib-samples", "-1"], "specdec compress: error: argument --calib-samples: must be >= 1, got -1"),
            (["--seq-len", "0"], "specdec compress: error: argument --seq-len: must be >= 2, got 0"),
            (["--eval-samples", "-2"], "specdec compress: error: argument --eval-samples: must be >= 0, got -2"),
            (["--calib-samples", "many"], "specdec compress: error: argument --calib-samples: expected an integer, "
                                          "got 'many'")]:
        proc = _cli(*base, *extra, cwd=ROOT)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        lines = proc.stderr.splitlines()
        assert first in lines and lines[-1] == first, proc.stderr  # argparse prints its usage first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.yaml"]


def _cli(*argv: str, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "SPECDEC_DEBUG": ""}
    return subprocess.run([sys.executable, "-m", "specdec.cli", *argv], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=300)


def test_compress_refuses_bad_output_paths_before_any_work(tmp_path, snapshot):
    """A file, or a directory specdec did not write (even with --overwrite), fails with one line and
    exit status 2 before the model is loaded (it does not exist here); nothing is touched."""
    (tmp_path / "file").write_text("mine")
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "notes.txt").write_text("keep me")
    before = snapshot(tmp_path)
    base = ["compress", "--model", str(tmp_path / "no-such-model"), "--recipe", str(tmp_path / "r.yaml")]
    for out, extra, message in [("file", [], "file exists and is not a directory"),
                                ("home", ["--overwrite"], "home is a non-empty directory that specdec did not write")]:
        proc = _cli(*base, "--out", str(tmp_path / out), *extra, cwd=ROOT)
        assert proc.returncode == 2, proc.stderr
        first = proc.stderr.splitlines()[0]
        assert first.startswith("specdec compress: error: ") and message in first, proc.stderr
        assert "Traceback" not in proc.stderr
    assert snapshot(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["file", "home"]


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


@pytest.mark.parametrize("flag, recipe_seq_len, given", [(["--seq-len", "100000"], 32, "--seq-len 100000"),
                                                         ([], 4096, "the calibration seq_len of")])
def test_compress_refuses_windows_longer_than_the_models_positions(tiny_dir, tmp_path, flag, recipe_seq_len, given):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"calibration: {{source: sharegpt, n_samples: 4, seq_len: {recipe_seq_len}}}\n"
                      "steps:\n  - {type: Int8WeightOnly, modules: ['*.attn.*']}\n")
    args = _parse(["compress", "--model", str(tiny_dir), "--recipe", str(recipe), "--out", str(tmp_path / "out"),
                   "--dtype", "float32", *flag])
    with pytest.raises(ValueError, match=f"^{given}.* is more than the 512 positions of --model {tiny_dir} "
                                         r"\(max_position_embeddings\); pass --seq-len 512 or less$"):
        args.func(args)
    assert not (tmp_path / "out").exists()
