"""distill.distill_draft on tiny random models: data, training, checkpoints and resume, LoRA, the
saved draft (loads, quantizes, stays lossless), two processes under accelerate, the CLI."""

from __future__ import annotations

import importlib
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import runtime
import specdec
from distill.divergence import masked_divergence
from distill.draft.onpolicy import batch_source, make_batch, sample_answers
from distill.draft.train import DistillConfig, distill_draft
from runtime.tiny import tiny_model

ROOT = Path(__file__).resolve().parents[3]
FAST = dict(lr=3e-3, max_new_tokens=12, mixed_precision="no", eval_every=100, eval_tokens=12, warmup_steps=2)


def _prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 9) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (int(torch.randint(lo, hi, (), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]


def _pair():
    return tiny_model("llama", seed=0), tiny_model("llama", seed=1)


def _heldout_gap(target, draft, prompts: list[list[int]], kind: str = "fkl") -> float:
    """Divergence of the draft from the target on the target's greedy answers to `prompts`."""
    answers = sample_answers(target, prompts, 12, 0.0, torch.Generator())
    b = make_batch(prompts, answers)
    with torch.no_grad():
        t = target(b.tokens, b.positions, None, logits_idx=b.idx).logits
        s = draft(b.tokens, b.positions, None, logits_idx=b.idx).logits
    return float(masked_divergence(s, t, b.valid, kind))


def test_make_batch_scores_exactly_the_answer_positions():
    b = make_batch([[5, 6, 7], [8]], [[9, 10], [11, 12, 13]], pad_id=0)
    assert b.tokens.tolist() == [[5, 6, 7, 9, 10], [8, 11, 12, 13, 0]]
    assert b.idx.tolist() == [[2, 3, 3], [0, 1, 2]]  # position t predicts token t + 1
    assert b.valid.tolist() == [[True, True, False], [True, True, True]]
    assert b.answer_tokens == 5
    empty = make_batch([[5, 6]], [[]])
    assert empty.answer_tokens == 0


def test_on_policy_answers_are_the_drafts_own_samples():
    target, draft = _pair()
    prompts = _prompts(3)
    assert batch_source("on-policy", 0.5, torch.Generator()) == "draft"
    assert batch_source("target", 0.5, torch.Generator()) == "target"
    a = sample_answers(draft, prompts, 10, 1.0, torch.Generator().manual_seed(7))
    b = sample_answers(draft, prompts, 10, 1.0, torch.Generator().manual_seed(7))
    c = sample_answers(draft, prompts, 10, 1.0, torch.Generator().manual_seed(8))
    assert a == b and a != c  # the explicit generator decides every sample
    greedy = sample_answers(draft, prompts, 10, 0.0, torch.Generator())
    for p, ans in zip(prompts, greedy):  # greedy on-policy answers are the draft's argmax continuations
        ids = torch.tensor([p + ans])
        with torch.no_grad():
            logits = draft(ids, torch.arange(ids.shape[1])[None], None).logits
        assert logits[0, len(p) - 1:-1].argmax(-1).tolist() == ans
    draws = [batch_source("mixed", 0.25, g) for g in [torch.Generator().manual_seed(0)] for _ in range(400)]
    assert 0.18 < draws.count("draft") / 400 < 0.32


@pytest.mark.parametrize("data,divergence", [("on-policy", "fkl"), ("target", "tvd"), ("mixed", "jsd"),
                                             ("on-policy", "rkl")])
def test_distillation_moves_the_draft_toward_the_target(data, divergence):
    target, draft = _pair()
    train, held = _prompts(24, seed=1), _prompts(6, seed=2)
    before = _heldout_gap(target, draft, held)
    cfg = DistillConfig(data=data, divergence=divergence, steps=15, **FAST)
    out = distill_draft(target, draft, train, cfg)
    assert out is draft and not any(p.requires_grad for p in out.parameters())
    assert _heldout_gap(target, out, held) < 0.8 * before


def test_bf16_autocast_trains_a_float32_draft_on_its_own_samples():
    target, draft = _pair()
    cfg = DistillConfig(steps=2, **{**FAST, "mixed_precision": "bf16"})
    out = distill_draft(target, draft, _prompts(8), cfg, heldout=_prompts(2, seed=3))
    assert out.dtype == torch.float32


def test_output_loads_quantizes_and_stays_lossless(tmp_path):
    import quant

    target, draft = _pair()
    prompts = _prompts(12)
    cfg = DistillConfig(steps=4, eval_every=2, **{k: v for k, v in FAST.items() if k != "eval_every"})
    distill_draft(target, draft, prompts, cfg, tmp_path / "out", heldout=prompts[:3])
    metrics = json.loads((tmp_path / "out" / "distill_metrics.json").read_text())
    assert [e["step"] for e in metrics["heldout"]] == [0, 2, 4]  # the undistilled draft, then every 2 steps
    assert all(1.0 <= e["tau"] <= cfg.eval_draft_tokens + 1 for e in metrics["heldout"])
    assert all(0.0 <= e["agreement"] <= 1.0 and e["positions"] > 0 for e in metrics["heldout"])
    assert (tmp_path / "out" / "distill.png").stat().st_size > 0
    loaded = runtime.load_model(tmp_path / "out", dtype=torch.float32)
    for name, t in loaded.state_dict().items():  # saved in bf16
        assert torch.equal(t, draft.state_dict()[name].to(torch.bfloat16).float()), name
    rows = [torch.tensor(p) for p in _prompts(4, seed=5)]
    plain = specdec.generate(target, rows, max_new_tokens=20)
    spec = specdec.generate(target, rows, draft=loaded, max_new_tokens=20)
    assert [s.tolist() for s in spec.sequences] == [s.tolist() for s in plain.sequences]
    quant.quantize_(loaded, quant.Int8WeightOnly())
    again = specdec.generate(target, rows, draft=loaded, max_new_tokens=20)
    assert [s.tolist() for s in again.sequences] == [s.tolist() for s in plain.sequences]


def test_resume_after_an_interruption_gives_the_uninterrupted_result(tmp_path):
    target, _ = _pair()
    prompts = _prompts(16)
    cfg = DistillConfig(steps=6, checkpoint_every=2, **FAST)
    whole = distill_draft(target, tiny_model("llama", seed=1), prompts, cfg, tmp_path / "whole")
    distill_draft(target, tiny_model("llama", seed=1), prompts, cfg, tmp_path / "parts", stop_after=3)
    assert json.loads((tmp_path / "parts" / "distill_checkpoint" / "latest.json").read_text())["step"] == 3
    resumed = distill_draft(target, tiny_model("llama", seed=1), prompts, cfg, tmp_path / "parts")
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)
    losses = [json.loads((tmp_path / d / "distill_metrics.json").read_text())["losses"] for d in ("whole", "parts")]
    assert losses[1] == pytest.approx(losses[0], rel=1e-4)


def test_resume_refuses_another_configuration(tmp_path):
    target, _ = _pair()
    prompts = _prompts(8)
    distill_draft(target, tiny_model("llama", seed=1), prompts, DistillConfig(steps=2, **FAST), tmp_path / "o",
                  stop_after=1)
    with pytest.raises(ValueError, match="other trainable weights"):
        distill_draft(target, tiny_model("llama", seed=1), prompts, DistillConfig(steps=2, lora=True, **FAST),
                      tmp_path / "o")


def test_lora_trains_adapters_and_merges_them_back():
    target, draft = _pair()
    original = {k: v.clone() for k, v in draft.state_dict().items()}
    held = _prompts(6, seed=2)
    before = _heldout_gap(target, draft, held)
    cfg = DistillConfig(steps=15, lora=True, **{**FAST, "lr": 1e-2, "eval_every": 5})
    out = distill_draft(target, draft, _prompts(24, seed=1), cfg, heldout=held[:2])
    state = out.state_dict()
    assert set(state) == set(original)  # plain linears again: no adapter left
    assert torch.equal(state["embed.weight"], original["embed.weight"])  # only the adapted linears moved
    assert not torch.equal(state["layers.0.attn.wqkv.weight"], original["layers.0.attn.wqkv.weight"])
    assert _heldout_gap(target, out, held) < 0.9 * before


def test_frozen_embeddings_stay_fixed():
    target, draft = _pair()
    embed = draft.embed.weight.detach().clone()
    distill_draft(target, draft, _prompts(8), DistillConfig(steps=2, freeze_embeddings=True, **FAST))
    assert torch.equal(draft.embed.weight, embed)


def test_bad_inputs_are_refused():
    target = tiny_model("llama", seed=0)
    with pytest.raises(ValueError, match="share its target's vocabulary"):
        distill_draft(target, tiny_model("llama", seed=1, vocab_size=96), _prompts(2))
    with pytest.raises(ValueError, match="no training prompts"):
        distill_draft(target, tiny_model("llama", seed=1), [])
    with pytest.raises(ValueError, match=r"DistillConfig.divergence must be one of"):
        DistillConfig(divergence="kl")


def test_a_refused_or_failed_distillation_leaves_no_output_directory(tmp_path, monkeypatch, snapshot):
    target = tiny_model("llama", seed=0)
    (tmp_path / "empty").mkdir()
    before = snapshot(tmp_path)
    cfg = DistillConfig(steps=2, **FAST)
    for where in (tmp_path / "new" / "out", tmp_path / "empty"):
        for prompts, heldout, message in [([[5, 6], [7, 128]], None, "prompts[1] holds token id 128, outside the "
                                                                       "models' vocabulary [0, 128)"),
                                          ([[5, 6]], [[-1]], "heldout[0] holds token id -1"),
                                          ([[5, 6], []], None, "prompts[1] is empty"),
                                          ([], None, "no training prompts")]:
            with pytest.raises(ValueError) as err:
                distill_draft(target, tiny_model("llama", seed=1), prompts, cfg, where, heldout=heldout)
            assert str(err.value).startswith(message)
        assert snapshot(tmp_path) == before
    dd = importlib.import_module("distill.draft.train")

    def failing(*args, **kwargs):  # the first batch fails (out of memory, say)
        raise RuntimeError("first batch failed")

    monkeypatch.setattr(dd, "masked_divergence", failing)
    for where in (tmp_path / "new" / "out", tmp_path / "empty"):
        with pytest.raises(RuntimeError, match="^first batch failed$"):
            distill_draft(target, tiny_model("llama", seed=1), _prompts(4), cfg, where)
        assert snapshot(tmp_path) == before


_TWO_PROCESS_SCRIPT = """
import json, sys, torch
from distill.draft.train import DistillConfig, distill_draft
from runtime.tiny import tiny_model
gen = torch.Generator().manual_seed(0)
prompts = [torch.randint(3, 128, (6,), generator=gen).tolist() for _ in range(16)]
cfg = DistillConfig(data="target", steps=4, batch_size=int(sys.argv[2]), lr=3e-3, max_new_tokens=10,
                    mixed_precision="no", warmup_steps=1, checkpoint_every=100)
distill_draft(tiny_model("llama", seed=0), tiny_model("llama", seed=1), prompts, cfg, sys.argv[1])
"""


def test_two_processes_match_one_at_the_same_global_batch(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(_TWO_PROCESS_SCRIPT))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, str(script), str(tmp_path / "one"), "4"], check=True, env=env, timeout=300)
    # `accelerate launch --cpu --num_processes 2` started a single process here (accelerate 1.15); its
    # torchrun launcher (--multi_gpu) starts two, and distill_draft's Accelerator(cpu=True) joins them over gloo
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--main_process_port", str(port), "--mixed_precision", "no"]
    run = subprocess.run([*launch, str(script), str(tmp_path / "two"), "2"], env=env, timeout=300,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-4000:]
    one, two = (json.loads((tmp_path / d / "distill_metrics.json").read_text()) for d in ("one", "two"))
    assert (one["processes"], two["processes"]) == (1, 2)
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-3)
    a = runtime.load_model(tmp_path / "one", dtype=torch.float32)
    b = runtime.load_model(tmp_path / "two", dtype=torch.float32)
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(x, y, rtol=2e-2, atol=2e-3, msg=name)  # both saved in bf16


def test_cli_flags_come_from_the_config_and_the_command_takes_more_subcommands():
    import dataclasses

    from distill.command import distill_subparsers
    from specdec.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["distill", "draft", "--target", "t", "--draft", "d", "--out", "o"])
    for f in dataclasses.fields(DistillConfig):
        assert getattr(args, f.name) == f.default, f.name  # CLI defaults are the function's
    args = parser.parse_args(["distill", "draft", "--target", "t", "--draft", "d", "--out", "o", "--divergence",
                              "tvd", "--data", "mixed", "--lora", "--beta", "0.1"])
    assert (args.divergence, args.data, args.lora, args.beta) == ("tvd", "mixed", True, 0.1)
    with pytest.raises(SystemExit):
        parser.parse_args(["distill", "draft", "--target", "t", "--draft", "d", "--out", "o", "--beta", "2"])
    top = parser._subparsers._group_actions[0]  # another pipeline adds its subcommand to the same command
    assert {"draft", "recover"} <= set(distill_subparsers(top).choices)
    distill_subparsers(top).add_parser("other").set_defaults(func=lambda a: 0)
    assert parser.parse_args(["distill", "other"]).distill_command == "other"


def test_a_draft_or_target_that_is_not_a_checkpoint_is_named_before_anything_loads(tmp_path, capsys, monkeypatch):
    """`distill draft --draft /nonexistent` (or a directory without config.json) names the option and
    the path; it used to say "no usable tokenizer"."""
    from specdec.cli import main

    monkeypatch.delenv("SPECDEC_DEBUG", raising=False)
    model = tmp_path / "model"
    tiny_model("llama", seed=0).config.hf_config.save_pretrained(model)  # a config.json is what is checked
    (tmp_path / "empty").mkdir()
    for target, draft, first in [
            (model, tmp_path / "nonexistent", f"--draft: '{tmp_path / 'nonexistent'}' does not exist. Pass a local "
                                              "checkpoint directory"),
            (model, tmp_path / "empty", f"--draft: {tmp_path / 'empty'} is not a model checkpoint (it has no "
                                        "config.json)"),
            (tmp_path / "nonexistent", model, f"--target: '{tmp_path / 'nonexistent'}' does not exist")]:
        argv = ["distill", "draft", "--target", str(target), "--draft", str(draft), "--out", str(tmp_path / "out")]
        assert main(argv) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith(f"specdec distill draft: error: {first}"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "model"]


def test_recipe_refuses_a_foreign_output_directory_before_any_work(tmp_path):
    (tmp_path / "mine.txt").write_text("not specdec's")
    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "distill_qwen05_draft.py"), "--out", str(tmp_path),
                           "--max-minutes", "1"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2
    assert "distill_qwen05_draft: error:" in proc.stderr and "did not write" in proc.stderr
    assert (tmp_path / "mine.txt").read_text() == "not specdec's" and len(list(tmp_path.iterdir())) == 1


def test_a_directory_holding_only_the_commands_cached_stubs_is_accepted(tmp_path):
    from distill.data.code_prompts import STUB_CACHE
    from distill.draft.train import check_distill_dir

    # `specdec distill draft` writes the function stubs into OUT before distill_draft checks OUT again
    (tmp_path / STUB_CACHE).write_text("[]")
    assert check_distill_dir(tmp_path) == tmp_path
    (tmp_path / "mine.txt").write_text("not specdec's")
    check_distill_dir(tmp_path)  # a marker is there: the directory is specdec's


def test_compared_runs_cover_every_divergence_and_source_and_drop_their_weights(tmp_path, monkeypatch):
    import importlib

    from distill.divergence import DIVERGENCES
    from distill.draft.onpolicy import DATA_SOURCES

    monkeypatch.syspath_prepend(str(ROOT / "recipes"))
    recipe = importlib.import_module("distill_qwen05_draft")
    runs = dict(recipe.compare_runs(3e-4))
    assert {(o["divergence"], o["data"]) for o in runs.values() if "lora" not in o} == {
        (d, s) for d in DIVERGENCES for s in DATA_SOURCES}
    assert runs["fkl-on-policy-lora"] == {"divergence": "fkl", "data": "on-policy", "lora": True, "lr": 3e-4}
    run = tmp_path / "fkl-target"
    (run / recipe.CHECKPOINTS / "step-0000002").mkdir(parents=True)
    for name in ("model.safetensors", "config.json", "distill_metrics.json", "distill.png"):
        (run / name).write_text("x")
    recipe._drop_weights(run, keep_draft=False)
    assert sorted(p.name for p in run.iterdir()) == ["distill.png", "distill_metrics.json"]


def test_recipe_evaluates_the_sets_asked_for_in_their_order(tmp_path, monkeypatch):
    import importlib

    monkeypatch.syspath_prepend(str(ROOT / "recipes"))
    recipe = importlib.import_module("distill_qwen05_draft")
    assert recipe.parser().parse_args([]).eval_sets == ["sharegpt", "humaneval"]
    assert recipe.parser().parse_args(["--eval-sets", "humaneval, sharegpt"]).eval_sets == ["humaneval", "sharegpt"]
    for bad in ("humaneval,humaneval", "mbpp", ","):
        with pytest.raises(SystemExit):
            recipe.parser().parse_args(["--eval-sets", bad])
    rows = [json.loads(line) for line in recipe._eval_prompts(tmp_path, 3, ["humaneval"]).read_text().splitlines()]
    assert [r["id"] for r in rows] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
