"""`specdec medusa` commands: re-measuring the heads' accuracy, restricting their guesses, rebuilding the
tree; training flags derived from MedusaTrainConfig; the argument types the recipes share."""

import argparse
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import distill
import runtime
from distill.command import parse_share
from distill.config_args import dataclass_from_args, flag_name
from distill.data.features import cache_hidden_states
from distill.medusa.train import MedusaTrainConfig
from specdec.cli import build_parser, main


def _tiny_checkpoint(path):
    """A 1-layer random Llama saved at `path` (a checkpoint the CLI can name), loaded in float32."""
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return runtime.load_model(path, dtype=torch.float32)


def test_tree_restricts_older_heads_to_the_training_vocabulary(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SPECDEC_DEBUG", raising=False)
    torch.manual_seed(0)
    model = _tiny_checkpoint(tmp_path / "tiny")
    g = torch.Generator().manual_seed(1)
    records = [{"id": i, "prompt_ids": torch.randint(0, 128, (4,), generator=g).tolist(),
                "output_ids": torch.randint(0, 48, (20,), generator=g).tolist()} for i in range(30)]
    cache = cache_hidden_states(model, records, tmp_path / "cache", num_heads=2, dtype=torch.float32)
    distill.save_medusa(distill.attach_medusa(model, num_heads=2), tmp_path / "heads")  # full vocabulary
    argv = ["medusa", "tree", "--model", str(tmp_path / "tiny"), "--dtype", "float32",
            "--heads", str(tmp_path / "heads"), "--num-nodes", "5"]
    assert main(argv + ["--data-vocab"]) == 2
    assert "--data-vocab needs --data-dir" in capsys.readouterr().err
    assert main(argv + ["--data-dir", str(cache), "--data-vocab"]) == 0
    heads = distill.load_medusa(tmp_path / "heads", model)
    assert heads.config.guess_vocab == 48 and int(heads.vocab.max()) == 47
    assert len(heads.tree.paths) == 5 and heads.config.head_accuracy is not None


def test_tree_auto_times_the_sizes_and_keeps_the_fastest_expected(tmp_path, capsys, monkeypatch, word_tokenizer):
    import json

    monkeypatch.delenv("SPECDEC_DEBUG", raising=False)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "tiny")
    word_tokenizer.save_pretrained(tmp_path / "tiny")  # HumanEval words map to <unk>: ids are all it needs
    model = runtime.load_model(tmp_path / "tiny", dtype=torch.float32)
    heads = distill.attach_medusa(model, num_heads=2)
    heads.set_tree(heads.tree.paths, head_accuracy=((0.5, 0.2), (0.3, 0.1)))
    distill.save_medusa(heads, tmp_path / "heads")
    argv = ["medusa", "tree", "--model", str(tmp_path / "tiny"), "--dtype", "float32",
            "--heads", str(tmp_path / "heads"), "--num-nodes", "auto", "--sizes", "1,3"]
    assert main(argv) == 0
    report = json.loads((tmp_path / "heads" / "tree_cost.json").read_text())
    best = max(report["trees"], key=lambda t: (t["expected_speedup"], -t["nodes"]))
    assert [t["nodes"] for t in report["trees"]] == [1, 3] and report["chosen_nodes"] == best["nodes"]
    assert len(distill.load_medusa(tmp_path / "heads", model).tree.paths) == best["nodes"]
    assert "expected speed" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(argv[:-4] + ["--num-nodes", "0"])
    assert "--num-nodes must be >= 1" in capsys.readouterr().err


def test_train_rejects_a_bad_feature_noise_before_loading_anything(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["medusa", "train", "--model", str(tmp_path / "no-such-model"), "--data", str(tmp_path / "none.jsonl"),
              "--out", str(tmp_path / "out"), "--feature-noise", "-0.5"])
    err = capsys.readouterr().err
    assert "--feature-noise" in err and "got -0.5" in err
    assert not (tmp_path / "out").exists()


def test_parse_share_rejects_values_outside_zero_one():
    assert parse_share("0.67") == 0.67
    for bad in ("1.2", "-0.1", "half"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_share(bad)


TRAIN_ARGS = ["medusa", "train", "--model", "m", "--data", "d.jsonl", "--out", "o"]


def test_every_train_config_field_is_a_train_flag_with_the_same_default(capsys):
    args = build_parser().parse_args(TRAIN_ARGS)
    for f in dataclasses.fields(MedusaTrainConfig):
        assert getattr(args, f.name) == f.default, f.name
    assert dataclass_from_args(MedusaTrainConfig, args) == MedusaTrainConfig()
    with pytest.raises(SystemExit):
        build_parser().parse_args(TRAIN_ARGS + ["--help"])
    usage = capsys.readouterr().out
    assert all(flag_name(f.name) in usage for f in dataclasses.fields(MedusaTrainConfig))


def test_train_flags_set_the_config_and_reject_bad_values_by_flag(capsys):
    args = build_parser().parse_args(TRAIN_ARGS + ["--lr", "5e-4", "--batch-size", "64", "--vocab", "data",
                                                   "--max-vocab", "16384", "--soft-targets", "--feature-noise",
                                                   "0.1", "--mixed-precision", "no", "--seed", "3"])
    cfg = dataclass_from_args(MedusaTrainConfig, args)
    assert cfg == MedusaTrainConfig(lr=5e-4, batch_size=64, vocab="data", max_vocab=16384, soft_targets=True,
                              feature_noise=0.1, mixed_precision="no", seed=3)
    for flag, bad in (("--max-vocab", "-1"), ("--max-vocab", "many"), ("--epochs", "0"), ("--vocab", "words")):
        with pytest.raises(SystemExit):
            build_parser().parse_args(TRAIN_ARGS + [flag, bad])
        assert f"argument {flag}" in capsys.readouterr().err


def test_data_and_train_default_to_the_hardwares_batch_dtype_and_tree_to_bf16(monkeypatch):
    from distill.command import arg_dtype
    from specdec.cli import build_parser

    parser = build_parser()
    common = ["--model", "m", "--out", "o"]
    assert parser.parse_args(["medusa", "data"] + common).dtype == "auto"
    args = parser.parse_args(["medusa", "train", "--data", "d.jsonl"] + common)
    assert (args.dtype, args.mixed_precision) == ("auto", "auto")
    assert parser.parse_args(["medusa", "tree", "--model", "m", "--heads", "h"]).dtype == "bfloat16"  # decode timing
    for native, expected in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda n=native: n)
        assert arg_dtype("auto") == expected
    assert arg_dtype("float16") == torch.float16


def _specdec(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specdec.cli", *argv], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[3], env={**os.environ, "SPECDEC_DEBUG": ""})


def test_medusa_commands_refuse_paths_specdec_did_not_write_before_loading_anything(tmp_path, capsys, monkeypatch):
    """data / train / tree fail with one line and exit status 2 (the model does not even exist);
    nothing outside the output path changes and the user's files are untouched."""
    monkeypatch.delenv("SPECDEC_DEBUG", raising=False)
    (tmp_path / "notes.txt").write_text("line one\nno newline at the end")
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "notes.txt").write_text("keep me")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    model = ["--model", str(tmp_path / "no-such-model")]
    proc = _specdec("medusa", "data", *model, "--out", str(tmp_path / "notes.txt"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.splitlines()[0].startswith("specdec medusa data: error: ")
    assert "notes.txt exists and is not a self-distillation jsonl" in proc.stderr.splitlines()[0]
    proc = _specdec("medusa", "train", *model, "--data", str(tmp_path / "sd.jsonl"), "--out", str(tmp_path / "home"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    first = proc.stderr.splitlines()[0]
    assert first.startswith("specdec medusa train: error: ")
    assert "home is a non-empty directory that specdec did" in first
    cases = [(["data", *model, "--out", str(tmp_path / "sd.jsonl"), "--hidden-cache", str(tmp_path / "home")],
              "home is a non-empty directory that specdec did not write"),
             (["train", *model, "--data", str(tmp_path / "sd.jsonl"), "--out", str(tmp_path / "notes.txt")],
              "notes.txt exists and is not a directory"),
             (["train", *model, "--data", str(tmp_path / "notes.txt"), "--out", str(tmp_path / "new")],
              "notes.txt is not a self-distillation jsonl"),
             (["train", *model, "--data", str(tmp_path / "sd.jsonl"), "--out", str(tmp_path / "new")],
              "--data: " + str(tmp_path / "sd.jsonl") + " does not exist"),
             (["train", *model, "--data", str(tmp_path / "home"), "--out", str(tmp_path / "new")],
              "--data: " + str(tmp_path / "home") + " is not a file"),
             (["tree", *model, "--heads", str(tmp_path / "home")], "home is not a Medusa heads directory")]
    for argv, message in cases:
        assert main(["medusa", *argv]) == 2
        first = capsys.readouterr().err.splitlines()[0]
        assert first.startswith(f"specdec medusa {argv[0]}: error: ") and message in first, (argv, first)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home", "notes.txt"]


def test_train_out_of_time_names_the_budget_and_leaves_no_output(tmp_path, capsys, monkeypatch, snapshot):
    """A budget that ends before the first cached record, or before the first step of training on a
    cache --hidden-cache already holds, is reported as such, and OUT is left as it was (a new one removed)."""
    import json

    monkeypatch.delenv("SPECDEC_DEBUG", raising=False)
    model = _tiny_checkpoint(tmp_path / "tiny")
    g = torch.Generator().manual_seed(1)
    records = [{"id": i, "prompt_ids": torch.randint(0, 128, (4,), generator=g).tolist(),
                "output_ids": torch.randint(0, 128, (12,), generator=g).tolist()} for i in range(10)]
    (tmp_path / "sd.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    cache = cache_hidden_states(model, records, tmp_path / "cache", num_heads=2, dtype=torch.float32)
    (tmp_path / "empty").mkdir()
    before = snapshot(tmp_path)
    argv = ["medusa", "train", "--model", str(tmp_path / "tiny"), "--dtype", "float32", "--data",
            str(tmp_path / "sd.jsonl"), "--num-heads", "2", "--max-minutes", "1e-9"]
    for extra, when in ((["--out", str(tmp_path / "new" / "heads")], "any training position was cached"),
                        (["--out", str(tmp_path / "empty")], "any training position was cached"),
                        (["--out", str(tmp_path / "new"), "--hidden-cache", str(cache)], "the first training step")):
        assert main(argv + extra) == 2
        first = capsys.readouterr().err.strip().splitlines()[-1]
        assert first.startswith("specdec medusa train: error: the time budget (--max-minutes") and when in first
        assert snapshot(tmp_path) == before


def test_the_medusa_recipe_refuses_a_directory_it_did_not_write_in_one_line(tmp_path):
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "notes.txt").write_text("keep me")
    recipe = Path(__file__).resolve().parents[3] / "recipes" / "medusa_smollm2.py"
    proc = subprocess.run([sys.executable, str(recipe), "--out", str(tmp_path / "home"), "--max-minutes", "1"],
                          capture_output=True, text=True, timeout=300, cwd=recipe.parents[1],
                          env={**os.environ, "SPECDEC_DEBUG": ""})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    first = proc.stderr.splitlines()[0]
    assert first.startswith("medusa_smollm2: error: ") and "home is a non-empty directory that specdec did" in first
    assert sorted(p.name for p in (tmp_path / "home").iterdir()) == ["notes.txt"]
