"""`specdec compress` (quant.command) and YAML recipes on a tiny checkpoint directory."""

import argparse
import json

import pytest
import torch

import runtime
from quant.command import register
from quant.recipe import load_recipe
from runtime.qlinear import Int8Linear, Sparse24Linear
from runtime.tiny import tiny_pair
from tests.quant.conftest import TEXTS


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
    model = runtime.load_model(tmp_path / "out", dtype=torch.float32)
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
