"""specdec.evaluation.evaluate: method parsing, settings, an end-to-end tiny run (plain vs transformers), resume."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import runtime
import specdec
from distill import attach_medusa, save_medusa
from runtime.output_paths import OutputLockedError, OutputPathError, output_lock
from specdec.evaluation import evaluate
from specdec.evaluation.evaluate import EvalConfig, Runner, SettingsMismatchError, run_eval
from specdec.evaluation.prompts import encode
from specdec.methods import BaselineSpec, DrafterSpec, Method, parse_methods

WORDS = ["<unk>", "<|eos|>", "<|user|>", "<|assistant|>", "def", "return", "the", "a", "of", "x",
         "print", "hello", "world"]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|> {% endif %}")


def tiny_tokenizer(eos: str = "<|eos|>") -> PreTrainedTokenizerFast:
    """A 128-word whitespace tokenizer with a chat template (built offline)."""
    words = WORDS + [f"w{i}" for i in range(128 - len(WORDS))]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token=eos,
                                   additional_special_tokens=["<|user|>", "<|assistant|>"],
                                   chat_template=CHAT_TEMPLATE)


def tiny_checkpoint(path: Path, seed: int = 0, eos_id: int = 1) -> Path:
    """A random tiny Llama saved as a HF checkpoint dir with tokenizer. Its generation config
    carries sampling defaults (repetition_penalty 1.3) that the transformers baselines must ignore."""
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      eos_token_id=eos_id, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.generation_config = GenerationConfig(eos_token_id=eos_id, repetition_penalty=1.3)
    model.save_pretrained(path)
    tok = tiny_tokenizer()
    words = tok.convert_ids_to_tokens(list(range(128)))
    tiny_tokenizer(eos=words[eos_id]).save_pretrained(path)
    return path


PROMPTS = [{"prompt": "def hello x", "category": "code", "id": "p0"},
           {"prompt": "print the world", "category": "chat", "id": "p1"},
           {"prompt": "return a of x", "category": "code", "id": "p2"},
           {"prompt": "hello world", "category": "chat", "id": "p3"}]


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A tiny checkpoint whose eos is the 4th token that greedy decoding emits for prompt p0."""
    root = tmp_path_factory.mktemp("eval")
    probe = tiny_checkpoint(root / "probe")
    tok = tiny_tokenizer()
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPTS[0]["prompt"]}],
                                  add_generation_prompt=True, tokenize=False)
    ids = tok(ids, add_special_tokens=False)["input_ids"]
    model = runtime.load_model(probe, dtype=torch.float32)
    out = specdec.generate(model, [torch.tensor(ids)], max_new_tokens=8).sequences[0][len(ids):].tolist()
    eos_id = next(t for i, t in enumerate(out) if i >= 3 and t not in out[:i] and t > 3)
    tiny_checkpoint(root / "ckpt", eos_id=eos_id)
    _write_jsonl(root / "prompts.jsonl", PROMPTS)
    target = runtime.load_model(root / "ckpt", dtype=torch.float32)
    save_medusa(attach_medusa(target, num_heads=2), root / "heads")
    torch.manual_seed(0)  # the head's random initialisation
    specdec.save_eagle(specdec.Eagle3Head(specdec.Eagle3Config.from_target(target, aux_layers=(0, 1, 1))),
                       root / "eagle")
    return root


def _cli(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="specdec")
    evaluate.register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def _base_args(workdir: Path, out: Path, *extra: str) -> list[str]:
    return ["eval", "--out", str(out), "--target", str(workdir / "ckpt"), "--prompts",
            str(workdir / "prompts.jsonl"), "--dtype", "float32", "--max-new-tokens", "12", *extra]


@pytest.fixture(scope="module")
def run_dir(workdir: Path) -> Path:
    out = workdir / "run"
    ck = workdir / "ckpt"  # draft = target: every drafted token is accepted
    methods = (f"plain,ngram,draft:{ck},hybrid:{ck},medusa:{workdir / 'heads'},eagle:{workdir / 'eagle'},hf,"
               f"hf-assisted:{ck},hf-pld")
    args = _cli(_base_args(workdir, out, "--methods", methods, "--limit", "3"))
    assert args.func(args) == 0
    return out


def test_parse_methods():
    specs = parse_methods("plain, draft:some/dir ,ngram,hybrid:m,medusa:heads,eagle:e,hf,hf-assisted:m,hf-pld")
    assert [s.kind for s in specs] == ["plain", "draft", "ngram", "hybrid", "medusa", "eagle", "hf", "hf-assisted",
                                       "hf-pld"]
    assert specs[1] == Method("draft:some/dir", DrafterSpec("draft", "some/dir"))
    assert specs[6] == Method("hf", BaselineSpec("hf"))
    assert specs[7] == Method("hf-assisted:m", BaselineSpec("hf-assisted", "m"))
    assert parse_methods("ngram@3,draft:d@auto")[1] == Method("draft:d@auto", DrafterSpec("draft", "d", "auto"))
    assert parse_methods("draft:/u@corp/ckpt")[0] == Method("draft:/u@corp/ckpt", DrafterSpec("draft", "/u@corp/ckpt"))
    assert parse_methods("eagle:e@8,eagle:e@auto")[0] == Method("eagle:e@8", DrafterSpec("eagle", "e", 8))
    assert parse_methods("eagle:e@96:8x10")[0] == Method("eagle:e@96:8x10", DrafterSpec("eagle", "e", 96, (8, 10)))
    assert parse_methods("eagle:e@auto:3x4")[0] == Method("eagle:e@auto:3x4", DrafterSpec("eagle", "e", "auto", (3, 4)))
    assert parse_methods("draft:/u@corp:1x2")[0].spec.arg == "/u@corp:1x2"  # no eagle, no draft length: a path
    for bad, msg in [("beam", "unknown method"), ("draft", "needs a model"), ("ngram:x", "takes no argument"),
                     ("ngram@3:2x2", "only eagle takes a tree shape"), ("eagle:e@0", "total_tokens must be"),
                     ("eagle:e@40:2x4", "exceeds the 20 candidates"), ("eagle:e@auto:1x0", "top_k must be"),
                     ("eagle:e@auto:1x1", "this shape holds 1"),
                     ("hf@3", "draft length"), ("ngram@0", "an integer in \\[1, 64\\]"),
                     ("ngram@65", "an integer in \\[1, 64\\]"),
                     ("plain,plain", "repeat"), ("hf-assisted:a,hf-assisted:b", "at most one"), (" , ", "no methods")]:
        with pytest.raises(ValueError, match=msg):
            parse_methods(bad)


def test_eagle_tree_nodes_per_method_and_auto(workdir, tmp_path):
    """eagle:PATH@N keeps N tree nodes; @auto times the sizes first and records them in tree_auto.json."""
    head = workdir / "eagle"
    args = _cli(_base_args(workdir, tmp_path / "e", "--methods",
                           f"plain,eagle:{head}@3,eagle:{head}@auto,eagle:{head}@70:3x6", "--limit", "2"))
    assert args.func(args) == 0
    rows = [json.loads(line) for line in (tmp_path / "e" / "generations.jsonl").read_text().splitlines()]
    plain = {r["id"]: r["output_ids"] for r in rows if r["method"] == "plain"}
    for r in rows:
        assert r["output_ids"] == plain[r["id"]]
    three = [r["stats"] for r in rows if r["method"] == f"eagle:{head}@3"]
    assert all(0 < s["drafted_tokens"] <= 3 * s["target_forwards"] for s in three)
    shaped = [r["stats"] for r in rows if r["method"] == f"eagle:{head}@70:3x6"]  # 70 > 64 nodes, paths <= 3
    assert all(0 < s["drafted_tokens"] <= 3 * s["target_forwards"] and len(s["position_drafted"]) <= 3
               for s in shaped)
    auto = json.loads((tmp_path / "e" / "tree_auto.json").read_text())[f"eagle:{head}@auto"]
    assert auto["prompt"] == "p0" and auto["chosen_nodes"] in [t["nodes"] for t in auto["trees"]]
    assert len(auto["trees"]) > 3


def test_per_method_draft_length(workdir, tmp_path):
    ck = workdir / "ckpt"  # draft = target: every step drafts (and accepts) exactly k tokens
    args = _cli(_base_args(workdir, tmp_path / "k", "--methods", f"plain,draft:{ck}@2,ngram@1,draft:{ck}@auto",
                           "--limit", "2", "--num-draft-tokens", "5"))
    assert args.func(args) == 0
    rows = [json.loads(line) for line in (tmp_path / "k" / "generations.jsonl").read_text().splitlines()]
    plain = {r["id"]: r["output_ids"] for r in rows if r["method"] == "plain"}
    for r in rows:
        assert r["output_ids"] == plain[r["id"]]
        if r["method"] == f"draft:{ck}@2":
            assert len(r["stats"]["per_position_acceptance"]) == 2
        if r["method"] == "ngram@1":
            assert len(r["stats"]["per_position_acceptance"]) <= 1


def test_config_validation(tmp_path):
    base = dict(out=str(tmp_path), prompts="p.jsonl")
    assert EvalConfig(**base, num_draft_tokens="3").num_draft_tokens == 3
    assert EvalConfig(**base, num_draft_tokens="auto").num_draft_tokens == "auto"
    for bad, msg in [(dict(num_draft_tokens=0), "num_draft_tokens"), (dict(num_draft_tokens="many"), "auto"),
                     (dict(dtype="float16"), "dtype"), (dict(dataset="humaneval"), "exactly one"),
                     (dict(max_new_tokens=0), "max_new_tokens"), (dict(temperature=-1.0), "temperature"),
                     (dict(methods="plain,bogus"), "unknown method"), (dict(threads=0), "threads"),
                     (dict(draft_vocab=1000), "multiple of 16"),
                     (dict(device="tpu"), "unknown device 'tpu'; use cpu, cuda or cuda:N")]:  # was torch's RuntimeError
        with pytest.raises(ValueError, match=msg):
            EvalConfig(**{**base, **bad})
    with pytest.raises(ValueError, match="exactly one"):
        EvalConfig(out=str(tmp_path))


def test_cli_defaults_equal_config_defaults(tmp_path):
    args = _cli(["eval", "--out", str(tmp_path), "--dataset", "humaneval"])
    for f in dataclasses.fields(EvalConfig):
        if f.name not in ("out", "dataset"):
            assert getattr(args, f.name) == f.default, f.name
    parser = argparse.ArgumentParser()
    help_text = evaluate.register(parser.add_subparsers()).format_help()
    for f in dataclasses.fields(EvalConfig):
        assert "--" + f.name.replace("_", "-") in help_text, f.name


def test_end_to_end_files_and_report(run_dir: Path):
    for name in ("run.json", "generations.jsonl", "report.json", "report.md", "acceptance.png", "speedup.png"):
        assert (run_dir / name).is_file(), name
    for png in ("acceptance.png", "speedup.png"):
        assert (run_dir / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = [json.loads(x) for x in (run_dir / "generations.jsonl").read_text().splitlines()]
    methods = list(json.loads((run_dir / "report.json").read_text())["methods"])
    assert len(methods) == 9
    assert [(r["id"], r["method"]) for r in lines] == [(p, m) for p in ("p0", "p1", "p2") for m in methods]
    report = json.loads((run_dir / "report.json").read_text())
    assert "bonus" in report["tau_convention"] and "bonus" in (run_dir / "report.md").read_text()
    assert set(report["versions"]) >= {"torch", "transformers", "specdec", "python", "platform", "cpu_count"}
    s = report["settings"]
    assert (s["dtype"], s["max_new_tokens"], s["k"], s["temperature"], s["num_prompts"]) == ("float32", 12, 5, 0.0, 3)
    assert report["command"].startswith("specdec eval --out") and "--methods plain,ngram,draft:" in report["command"]
    by_kind = {m.partition(":")[0]: report["methods"][m] for m in methods}
    plain, hf = by_kind["plain"], by_kind["hf"]
    for m in by_kind.values():
        assert set(m) == {"overall", "categories"} and set(m["categories"]) == {"code", "chat"}
        for group in [m["overall"], *m["categories"].values()]:
            assert {"tau", "acceptance_rate", "per_position_acceptance", "tokens_per_second", "speedup_vs_plain",
                    "speedup_vs_hf", "speedup_vs_hf-assisted", "speedup_vs_hf-pld", "matches_plain",
                    "stats"} <= set(group)
        # float32 greedy: every method (ours lossless, transformers' too) equals plain decoding on every
        # prompt; for transformers this also checks the checkpoint's repetition_penalty does not leak in
        assert m["overall"]["matches_plain"] == 1.0
    assert plain["overall"]["tau"] == 1.0 and plain["overall"]["acceptance_rate"] is None
    for kind in ("hf", "hf-assisted", "hf-pld"):
        assert by_kind[kind]["overall"]["tau"] is None and by_kind[kind]["overall"]["stats"] is None
    draft = by_kind["draft"]["overall"]
    assert draft["acceptance_rate"] == 1.0 and set(draft["per_position_acceptance"]) == {1.0}
    assert draft["tau"] > 2.0 and len(draft["per_position_acceptance"]) == 5
    for kind in ("ngram", "hybrid", "medusa", "eagle"):
        o = by_kind[kind]["overall"]
        assert o["tau"] >= 1.0 and o["stats"]["drafted_tokens"] > 0 and o["per_position_acceptance"]
    ratio = plain["overall"]["tokens_per_second"] / hf["overall"]["tokens_per_second"]
    assert plain["overall"]["speedup_vs_hf"] == pytest.approx(ratio)
    assert hf["overall"]["speedup_vs_plain"] == pytest.approx(1 / ratio)


def test_tokens_counted_up_to_and_including_eos(run_dir: Path, workdir: Path):
    eos = json.loads((run_dir / "run.json").read_text())["settings"]["eos_token_id"]
    lines = [json.loads(x) for x in (run_dir / "generations.jsonl").read_text().splitlines()]
    p0 = [r for r in lines if r["id"] == "p0"]
    for r in p0:  # the fixture's eos is the 4th greedy token of p0
        assert len(r["output_ids"][0]) == 4 and r["output_ids"][0][-1] in eos and r["new_tokens"] == 4
    for r in lines:
        ids = r["output_ids"][0]
        assert r["new_tokens"] == len(ids) <= 12
        assert all(t not in eos for t in ids[:-1])
        assert r["tokens_per_second"] == pytest.approx(r["new_tokens"] / r["wall_s"])


def _count_decodes(monkeypatch) -> list:
    calls = []
    original = Runner.decode

    def counting(self, spec, ids, seed):
        calls.append(spec.name)
        return original(self, spec, ids, seed)

    monkeypatch.setattr(Runner, "decode", counting)
    return calls


def test_resume_skips_done_prompts(workdir: Path, monkeypatch):
    out = workdir / "resume"
    cfg = dict(out=str(out), methods="plain,hf", target=str(workdir / "ckpt"),
               prompts=str(workdir / "prompts.jsonl"), dtype="float32", max_new_tokens=6, limit=2)
    calls = _count_decodes(monkeypatch)
    run_eval(EvalConfig(**cfg), command="first", progress=False)
    assert calls == ["plain", "hf"] + ["plain", "hf"] * 2  # warm-up, then prompt-major order
    first = (out / "generations.jsonl").read_text()
    calls.clear()
    report = run_eval(EvalConfig(**cfg), command="again", progress=False)
    assert calls == [] and (out / "generations.jsonl").read_text() == first
    assert report["command"] == "again" and report["settings"]["num_prompts"] == 2
    # a killed run leaves a partial line: it is dropped and that generation is redone
    with (out / "generations.jsonl").open("a") as fh:
        fh.write('{"id": "p2", "method": "pla')
    report = run_eval(EvalConfig(**{**cfg, "limit": 3}), command="more", progress=False)
    assert calls == ["plain", "hf", "plain", "hf"]
    lines = [json.loads(x) for x in (out / "generations.jsonl").read_text().splitlines()]
    assert [(r["id"], r["method"]) for r in lines][-2:] == [("p2", "plain"), ("p2", "hf")] and len(lines) == 6
    assert report["methods"]["hf"]["overall"]["num_prompts"] == 3


def test_a_resumed_run_drafts_suffix_from_the_answers_already_written(workdir: Path, monkeypatch, tmp_path):
    """The suffix cache of a resumed run starts with the method's answers in generations.jsonl, so the
    prompts after the interrupt draft (and accept) as in a run that was never interrupted."""
    from specdec.drafters import suffix

    monkeypatch.setattr(suffix, "batch_cut", lambda values, costs: max(map(len, values)))  # no cut by timings
    same = {"prompt": "print the world", "category": "chat"}  # prompt b's answer is prompt a's: in the cache
    prompts = _write_jsonl(tmp_path / "twice.jsonl", [{**same, "id": "a"}, {**same, "id": "b"}])
    cfg = dict(methods="suffix", target=str(workdir / "ckpt"), prompts=str(prompts), dtype="float32",
               max_new_tokens=24)

    def stats(out: Path) -> dict:
        lines = [json.loads(x) for x in (out / "generations.jsonl").read_text().splitlines()]
        return {r["id"]: {k: r["stats"][k] for k in ("drafted_tokens", "accepted_tokens", "target_forwards")}
                for r in lines}

    run_eval(EvalConfig(out=str(tmp_path / "whole"), **cfg), progress=False)
    run_eval(EvalConfig(out=str(tmp_path / "resumed"), limit=1, **cfg), progress=False)  # interrupted after a
    run_eval(EvalConfig(out=str(tmp_path / "resumed"), **cfg), progress=False)
    whole = stats(tmp_path / "whole")
    assert stats(tmp_path / "resumed") == whole
    assert whole["b"]["accepted_tokens"] > whole["a"]["accepted_tokens"]  # b drafted a's answer
    monkeypatch.setattr(evaluate, "earlier_answers", lambda records: {})  # what resuming did before
    run_eval(EvalConfig(out=str(tmp_path / "forgot"), limit=1, **cfg), progress=False)
    run_eval(EvalConfig(out=str(tmp_path / "forgot"), **cfg), progress=False)
    assert stats(tmp_path / "forgot")["b"] != whole["b"]


def test_a_corrupt_line_or_run_file_is_named_with_what_to_do(workdir: Path, capsys, monkeypatch):
    """Resuming over a corrupt generations.jsonl line names the file and its 1-based line number and
    says what to do (it used to be a bare JSON error); a corrupt run.json names that file."""
    from specdec.cli import main

    out = workdir / "corrupt"
    argv = ["eval", "--out", str(out), "--target", str(workdir / "ckpt"), "--prompts", str(workdir / "prompts.jsonl"),
            "--methods", "plain", "--limit", "2", "--warmup", "0", "--dtype", "float32", "--max-new-tokens", "4"]
    monkeypatch.delenv("SPECDEC_DEBUG", raising=False)
    assert main(argv) == 0
    path = out / "generations.jsonl"
    good = path.read_text().splitlines()
    then = "the file is corrupt: delete that line to resume (its generation is made again), or start over with a " \
           "new --out (or --overwrite, which discards this run)"
    capsys.readouterr()
    for bad, problem in [('{"id": "p1", "meth', "not JSON (Unterminated string starting at column 14)"),
                         ("[1, 2]", "not a generation record (a JSON object with an 'id' and a 'method')")]:
        path.write_text("\n".join([good[0], bad, good[1]]) + "\n")
        assert main(argv) == 2
        err = capsys.readouterr().err.splitlines()
        assert err == [f"specdec eval: error: {path}, line 2: {problem}; {then}"], err
    path.write_text("\n".join(good) + "\n")
    (out / "run.json").write_text('{"settings": ')
    assert main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"specdec eval: error: {out / 'run.json'} cannot be read back "
                                               "(JSONDecodeError: Expecting value"), err
    assert err[0].endswith("the file is corrupt: start over with a new --out (or --overwrite, which discards "
                           "this run)"), err


def test_settings_mismatch_fails_unless_overwrite(workdir: Path):
    cfg = dict(out=str(workdir / "mismatch"), methods="plain", target=str(workdir / "ckpt"),
               prompts=str(workdir / "prompts.jsonl"), dtype="float32", max_new_tokens=4, limit=1, warmup=0)
    run_eval(EvalConfig(**cfg), progress=False)
    with pytest.raises(SettingsMismatchError, match=r"max_new_tokens: 4 -> 5.*--overwrite"):
        run_eval(EvalConfig(**{**cfg, "max_new_tokens": 5}), progress=False)
    report = run_eval(EvalConfig(**{**cfg, "max_new_tokens": 5, "overwrite": True}), progress=False)
    assert report["settings"]["max_new_tokens"] == 5
    lines = (workdir / "mismatch" / "generations.jsonl").read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["new_tokens"] <= 5


def test_all_turns_conversation(workdir: Path, monkeypatch):
    mt = _write_jsonl(workdir / "mt.jsonl", [
        {"question_id": 81, "category": "writing", "turns": ["hello world", "print the x"]},
        {"question_id": 82, "category": "coding", "turns": ["def x", "return a"]}])
    inputs = []
    original = Runner.decode

    def recording(self, spec, ids, seed):
        inputs.append((spec.name, list(ids)))
        return original(self, spec, ids, seed)

    monkeypatch.setattr(Runner, "decode", recording)
    report = run_eval(EvalConfig(out=str(workdir / "mt"), methods="plain,hf", target=str(workdir / "ckpt"),
                                 prompts=str(mt), all_turns=True, dtype="float32", max_new_tokens=5, warmup=0),
                      progress=False)
    lines = [json.loads(x) for x in (workdir / "mt" / "generations.jsonl").read_text().splitlines()]
    assert len(lines) == 4 and all(len(r["outputs"]) == len(r["output_ids"]) == 2 for r in lines)
    first = [r for r in lines if r["id"] == "81" and r["method"] == "plain"][0]
    turn1, turn2 = [ids for name, ids in inputs if name == "plain"][:2]
    # turn 2's input = user turn 1, the method's own answer, user turn 2 (chat template)
    tok = runtime.load_tokenizer(workdir / "ckpt")
    assert turn2 == encode(tok, ["hello world", "print the x"], [first["outputs"][0]], raw=False)
    assert turn2[:len(turn1)] == turn1
    assert first["new_tokens"] == sum(len(x) for x in first["output_ids"])
    assert report["methods"]["hf"]["overall"]["matches_plain"] == 1.0
    assert set(report["methods"]["plain"]["categories"]) == {"writing", "coding"}


LONG = {"prompt": " ".join(f"w{i % 100}" for i in range(600)), "category": "code", "id": "long"}


def test_a_prompt_longer_than_the_context_is_skipped_recorded_and_not_retried(workdir: Path, monkeypatch):
    prompts = _write_jsonl(workdir / "with_long.jsonl", [LONG, *PROMPTS[:2]])  # the first one: warm-up skips it too
    cfg = EvalConfig(out=str(workdir / "long"), methods="plain,ngram", target=str(workdir / "ckpt"),
                     prompts=str(prompts), dtype="float32", max_new_tokens=6)
    report = run_eval(cfg, progress=False)
    assert report["skipped"] and report["skipped"][0]["id"] == "long"
    assert "exceeds the model's 512 positions" in report["skipped"][0]["reason"]
    assert report["settings"]["num_prompts"] == 2
    assert all(m["overall"]["num_prompts"] == 2 for m in report["methods"].values())
    lines = [json.loads(x) for x in (workdir / "long" / "generations.jsonl").read_text().splitlines()]
    assert [(r["id"], r.get("skipped") is not None) for r in lines][0] == ("long", True)
    assert [(r["id"], r["method"]) for r in lines[1:]] == [(p, m) for p in ("p0", "p1") for m in ("plain", "ngram")]
    md = (workdir / "long" / "report.md").read_text()
    assert "Skipped 1 prompt that did not fit the context" in md and "`long`" in md
    calls = _count_decodes(monkeypatch)
    again = run_eval(cfg, progress=False)  # resume: nothing left, the long prompt is not tried again
    assert calls == [] and again["skipped"] == report["skipped"]


def test_out_must_be_new_empty_or_an_evaluation_run(workdir: Path, tmp_path: Path):
    base = dict(methods="plain", target=str(workdir / "ckpt"), prompts=str(workdir / "prompts.jsonl"),
                dtype="float32", max_new_tokens=4, limit=1, warmup=0)
    (tmp_path / "file").write_text("mine")
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "notes.txt").write_text("keep me")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(OutputPathError, match="file exists and is not a directory"):
        run_eval(EvalConfig(out=str(tmp_path / "file"), **base), progress=False)
    for overwrite in (False, True):
        with pytest.raises(OutputPathError, match="home is a non-empty directory that specdec did not write"):
            run_eval(EvalConfig(out=str(tmp_path / "home"), overwrite=overwrite, **base), progress=False)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "home"]
    # --overwrite discards a run's own files only: a file the user put beside them stays
    run = tmp_path / "run"
    run_eval(EvalConfig(out=str(run), **base), progress=False)
    (run / "notes.txt").write_text("keep me")
    run_eval(EvalConfig(out=str(run), overwrite=True, **{**base, "max_new_tokens": 3}), progress=False)
    assert (run / "notes.txt").read_text() == "keep me" and not (run / ".lock").exists()
    # bad input found before anything is written leaves no empty directory behind
    with pytest.raises(FileNotFoundError):
        run_eval(EvalConfig(out=str(tmp_path / "new"), **{**base, "prompts": str(tmp_path / "none.jsonl")}),
                 progress=False)
    assert not (tmp_path / "new").exists()


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every path under `root` with its bytes (None for a directory): a snapshot to compare."""
    return {str(p.relative_to(root)): None if p.is_dir() else p.read_bytes() for p in sorted(root.rglob("*"))}


def test_a_run_that_fails_before_its_first_line_leaves_out_as_it_was(workdir: Path, tmp_path: Path, monkeypatch):
    base = dict(methods="plain", target=str(workdir / "ckpt"), prompts=str(workdir / "prompts.jsonl"),
                dtype="float32", max_new_tokens=4, limit=2, warmup=0)
    original, calls, fail_at = Runner.decode, [], [1]

    def faulty(self, spec, ids, seed):  # the model raises at the fail_at-th generation
        calls.append(spec.name)
        if len(calls) == fail_at[0]:
            raise RuntimeError("injected fault")
        return original(self, spec, ids, seed)

    monkeypatch.setattr(Runner, "decode", faulty)
    (tmp_path / "empty").mkdir()
    before = _tree(tmp_path)
    for out in (tmp_path / "new" / "run", tmp_path / "empty"):  # a new path (and parent), an empty directory
        calls.clear()
        with pytest.raises(RuntimeError, match="^injected fault$"):
            run_eval(EvalConfig(out=str(out), **base), progress=False)
        assert _tree(tmp_path) == before  # no run.json, no 0-byte generations.jsonl, no directory
    # a line written: the run is kept for resuming, and a resumed run that fails deletes nothing
    out, fail_at[0] = tmp_path / "kept", 2
    calls.clear()
    with pytest.raises(RuntimeError, match="^injected fault$"):
        run_eval(EvalConfig(out=str(out), **base), progress=False)
    kept = _tree(out)
    assert sorted(kept) == ["generations.jsonl", "run.json"] and len(kept["generations.jsonl"].splitlines()) == 1
    calls.clear()
    fail_at[0] = 1
    with pytest.raises(RuntimeError, match="^injected fault$"):
        run_eval(EvalConfig(out=str(out), **base), progress=False)
    assert _tree(out) == kept
    fail_at[0] = 0
    assert run_eval(EvalConfig(out=str(out), **base), progress=False)["settings"]["num_prompts"] == 2
    assert len((out / "generations.jsonl").read_text().splitlines()) == 2


def test_a_second_eval_on_the_same_out_fails_at_once(workdir: Path, tmp_path: Path):
    out = tmp_path / "busy"
    out.mkdir()
    cfg = EvalConfig(out=str(out), methods="plain", target=str(workdir / "ckpt"),
                     prompts=str(workdir / "prompts.jsonl"), dtype="float32", max_new_tokens=4, limit=1, warmup=0)
    with output_lock(out, "specdec eval"):
        with pytest.raises(OutputLockedError, match=rf"busy is in use by another specdec eval \(pid {os.getpid()}\)"):
            run_eval(cfg, progress=False)
        assert sorted(p.name for p in out.iterdir()) == [".lock"]  # the holder's lock, nothing else written
    (out / ".lock").write_text("999999999\n")  # left by a killed run: taken over
    assert run_eval(cfg, progress=False)["settings"]["num_prompts"] == 1


def _specdec(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specdec.cli", *argv], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[3], env={**os.environ, "SPECDEC_DEBUG": ""})


def test_cli_bad_out_and_busy_out_are_one_line_errors(workdir: Path, tmp_path: Path):
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "notes.txt").write_text("keep me")
    (tmp_path / "busy").mkdir()
    args = ["--target", str(workdir / "ckpt"), "--prompts", str(workdir / "prompts.jsonl"), "--methods", "plain"]
    with output_lock(tmp_path / "busy", "specdec eval"):
        for out, message in [("home", "home is a non-empty directory that specdec did not write"),
                             ("busy", "busy is in use by another specdec eval")]:
            proc = _specdec("eval", "--out", str(tmp_path / out), "--overwrite", *args)
            assert proc.returncode == 2, proc.stderr
            first = proc.stderr.splitlines()[0]
            assert first.startswith("specdec eval: error: ") and message in first, proc.stderr
            assert "Traceback" not in proc.stderr
    assert (tmp_path / "home" / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in (tmp_path / "home").iterdir()) == ["notes.txt"]
    assert list((tmp_path / "busy").iterdir()) == []


def test_suffix_methods_draft_from_their_own_answers_and_not_the_warm_up(workdir: Path, monkeypatch):
    """Each method keeps its own cache of earlier answers, emptied after the warm-up: a run with a
    warm-up drafts exactly as one without, and a second suffix method does not see the first's.
    The cut by timed verification costs is off here: it follows the wall clock (a loaded machine
    cuts other trees), and what is compared is the cache."""
    from specdec.tuning.costs import BlockCosts

    monkeypatch.setattr(BlockCosts, "known", lambda self: False)
    base = dict(target=str(workdir / "ckpt"), prompts=str(workdir / "prompts.jsonl"), dtype="float32",
                max_new_tokens=12, limit=3)
    runs = [run_eval(EvalConfig(out=str(workdir / f"suffix{w}"), methods="suffix,suffix@4", warmup=w, **base),
                     progress=False) for w in (0, 1)]
    gens = [[json.loads(x) for x in (workdir / f"suffix{w}" / "generations.jsonl").read_text().splitlines()]
            for w in (0, 1)]
    counts = [[{k: g["stats"][k] for k in ("drafted_tokens", "accepted_tokens", "target_forwards")} for g in run]
              for run in gens]
    assert counts[0] == counts[1] and any(c["accepted_tokens"] for c in counts[0])
    assert runs[0]["methods"]["suffix"]["overall"]["num_prompts"] == 3
    ck = workdir / "ckpt"
    both = run_eval(EvalConfig(out=str(workdir / "composite"), methods=f"plain,suffix|draft:{ck}@auto:p0.2",
                               **base), progress=False)
    assert both["methods"][f"suffix|draft:{ck}@auto:p0.2"]["overall"]["num_prompts"] == 3
    runner = Runner(EvalConfig(out=str(workdir / "unused"), methods="suffix", **base), None, [])
    caches = []
    for method in ("suffix", "suffix@4"):
        runner.method = method
        caches.append(runner.loader.suffix_cache(24, 100))
    assert caches[0] is not caches[1] and caches[1] is runner.loader.suffix_cache(24, 100)
    caches[0].extend(caches[0].open(), [], [5, 6, 7])
    runner.loader.forget_answers()
    assert caches[0].tokens == 0 and caches[0].responses == 0
    records = [runner.loader.composite_records("ngram|suffix", 2)]  # composites: one set of records per method
    runner.method = "suffix"
    records.append(runner.loader.composite_records("ngram|suffix", 2))
    assert records[0] is not records[1] and records[1] is runner.loader.composite_records("ngram|suffix", 2)


def test_a_compiled_warm_up_runs_a_composites_members_alone_too():
    """A composite's gates may never run its draft model in the warm-up: each member is warmed up
    alone as well, so no member compiles a program while it is timed."""
    from types import SimpleNamespace

    from specdec.evaluation.prompts import Prompt
    from specdec.tuning.warmup import COMPILE_WARMUP_DRAFTS

    decoded = []
    runner = SimpleNamespace(cfg=SimpleNamespace(compile=True, raw=True, seed=0), target=object(),
                             tokenizer=lambda text, add_special_tokens: {"input_ids": [1, 2, 3]},
                             decode=lambda spec, ids, seed: decoded.append((spec.name, spec.draft_length)))
    evaluate._warm_up(runner, Method.parse("suffix|draft:d@auto"), [Prompt("p", "code", ("x",))])
    assert [name for name, _ in decoded] == ["suffix|draft:d@auto"] * 4 + ["suffix"] + ["draft:d@auto"] * 4
    assert [k for name, k in decoded if name == "draft:d@auto"] == ["auto", *COMPILE_WARMUP_DRAFTS]
