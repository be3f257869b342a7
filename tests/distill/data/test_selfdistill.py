"""Self-distillation data: chat-template prompts, the model's own answers, resume."""

import json

import pytest
import torch

import specdec
from distill.data.features import cache_hidden_states, load_cached
from distill.data.selfdistill import chat_prompt_ids, generate_selfdistill, is_code_prompt, read_records, stop_token_ids
from runtime.output_paths import OutputPathError


def test_chat_prompt_and_stop_tokens(word_tokenizer):
    ids = chat_prompt_ids(word_tokenizer, "w1 w2")
    assert ids == word_tokenizer.convert_tokens_to_ids(
        ["<|im_start|>", "user", "w1", "w2", "<|im_end|>", "<|im_start|>", "assistant"])
    assert stop_token_ids(word_tokenizer) == [2]


@pytest.mark.parametrize("command, flag", [("medusa data", "--model"), ("eagle data", "--target"),
                                           ("distill draft", "--draft")])
def test_commands_refuse_a_tokenizer_without_chat_template_by_model_before_loading_it(command, flag, word_tokenizer,
                                                                                      tmp_path, capsys, monkeypatch,
                                                                                      snapshot):
    """The checkpoint has a config and a tokenizer but no weights: the tokenizer is checked first."""
    import copy

    from transformers import LlamaConfig

    from specdec.cli import main

    monkeypatch.delenv("SPECDEC_DEBUG", raising=False)
    ckpt = tmp_path / "plain"
    LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2).save_pretrained(ckpt)
    plain = copy.deepcopy(word_tokenizer)
    plain.chat_template = None
    plain.save_pretrained(ckpt)
    before = snapshot(tmp_path)
    models = {"--draft": ["--target", str(ckpt), "--draft", str(ckpt)]}.get(flag, [flag, str(ckpt)])
    out = str(tmp_path / ("sd.jsonl" if command.endswith("data") else "out"))
    assert main([*command.split(), *models, "--out", out]) == 2
    first = capsys.readouterr().err.splitlines()[0]
    assert first.startswith(f"specdec {command}: error: {flag} {ckpt}: the tokenizer has no chat template"), first
    assert "use a chat model" in first and snapshot(tmp_path) == before
    with pytest.raises(ValueError, match="has no chat template"):
        chat_prompt_ids(plain, "w1")


@pytest.mark.parametrize("text, code", [
    ("Write a Python function that sorts a list", True), ("In Java, replace {object} in a string", True),
    ("Use C# to get the thumbnail", True), ("How do I learn Node.js?", True), ("call the API.", True),
    ("git rebase or merge?", True), ("C++ templates explained", True),
    ("I trust my editor", False), ("the capital of France", False), ("a chemical reaction", False),
    ("digital art ideas", False), ("tell me a story about a cat", False),
])
def test_code_prompts_match_keywords_and_whole_word_language_names(text, code):
    assert is_code_prompt(text) is code


def test_answers_are_the_models_own_and_generation_resumes(tiny_model, word_tokenizer, tmp_path):
    prompts = [(i, chat_prompt_ids(word_tokenizer, f"w{i} w{i + 3} w7")) for i in range(7)]
    out = tmp_path / "sd.jsonl"
    n = generate_selfdistill(tiny_model, word_tokenizer, out, prompts[:3], max_new_tokens=10,
                             batch_size=2)
    assert n == 3
    with open(out, "a") as f:  # a run killed mid-line
        f.write('{"id": 5, "prompt_')
    n = generate_selfdistill(tiny_model, word_tokenizer, out, prompts, max_new_tokens=10, batch_size=2)
    assert n == 7
    records = read_records(out)
    assert sorted(r["id"] for r in records) == list(range(7))
    assert out.read_text().count("\n") == 7 and all(json.loads(line) for line in out.read_text().splitlines())
    for r in records:
        ref = specdec.generate(tiny_model, [torch.tensor(r["prompt_ids"])], max_new_tokens=10,
                               eos_token_id=2).sequences[0]
        assert r["prompt_ids"] + r["output_ids"] == ref.tolist()


def test_sampled_answers_are_reproducible(tiny_model, word_tokenizer, tmp_path):
    prompts = [(i, chat_prompt_ids(word_tokenizer, f"w{i}")) for i in range(4)]
    a = generate_selfdistill(tiny_model, word_tokenizer, tmp_path / "a.jsonl", prompts, max_new_tokens=8,
                             temperature=1.0, seed=3)
    b = generate_selfdistill(tiny_model, word_tokenizer, tmp_path / "b.jsonl", prompts, max_new_tokens=8,
                             temperature=1.0, seed=3)
    assert a == b == 4
    assert read_records(tmp_path / "a.jsonl") == read_records(tmp_path / "b.jsonl")


def test_hidden_states_kept_during_generation_equal_a_second_pass(tiny_model, word_tokenizer, tmp_path):
    prompts = [(i, chat_prompt_ids(word_tokenizer, " ".join(f"w{j}" for j in range(i, 2 * i + 2))))
               for i in range(25)]
    out, cache = tmp_path / "sd.jsonl", tmp_path / "cache"
    generate_selfdistill(tiny_model, word_tokenizer, out, prompts[:4], max_new_tokens=12, batch_size=3)
    cache_hidden_states(tiny_model, read_records(out)[:2], cache, num_heads=2)
    # the cache holds records 0-1; 2-3 come from a second pass, the rest from generation
    n = generate_selfdistill(tiny_model, word_tokenizer, out, prompts, max_new_tokens=12, batch_size=3,
                             hidden_cache=cache, num_heads=2)
    assert n == 25 and json.loads((cache / "manifest.json").read_text())["records_done"] == 25
    ref = cache_hidden_states(tiny_model, read_records(out), tmp_path / "ref", num_heads=2)
    for split in ("train", "heldout"):
        h, t = load_cached(cache, split, 2)
        h_ref, t_ref = load_cached(ref, split, 2)
        assert torch.equal(t, t_ref)
        torch.testing.assert_close(h.float(), h_ref.float(), rtol=0.02, atol=0.02)  # bf16 storage
    assert load_cached(cache, "heldout", 2)[0].shape[0] > 0
    with pytest.raises(ValueError, match="belongs to other data"):  # fewer records than the cache
        generate_selfdistill(tiny_model, word_tokenizer, tmp_path / "other.jsonl", prompts[:2],
                             max_new_tokens=12, hidden_cache=cache, num_heads=2)
    other = read_records(out)[::-1] + read_records(out)  # more records; the 25th is not the cache's last
    with pytest.raises(ValueError, match="belongs to other data"):
        cache_hidden_states(tiny_model, other, cache, num_heads=2)


def test_eagle_features_kept_during_generation_equal_a_second_pass(tiny_model, word_tokenizer, tmp_path):
    """The aux and final states from generation's own forwards equal cache_eagle_states' pass over
    the records (the last answer token's aux row, which generation never computes, is stored as
    zeros and read by no training step); records written before the cache existed are caught up."""
    from distill.data.features import cache_eagle_states, load_split

    layers = (1, 0, 1)
    prompts = [(i, chat_prompt_ids(word_tokenizer, " ".join(f"w{j}" for j in range(i, 2 * i + 2))))
               for i in range(12)]
    out, cache = tmp_path / "sd.jsonl", tmp_path / "cache"
    generate_selfdistill(tiny_model, word_tokenizer, out, prompts[:3], max_new_tokens=12, batch_size=3)
    n = generate_selfdistill(tiny_model, word_tokenizer, out, prompts, max_new_tokens=12, batch_size=3,
                             eagle_cache=cache, aux_layers=layers, heldout_every=4)
    assert n == 12 and json.loads((cache / "manifest.json").read_text())["records_done"] == 12
    ref = cache_eagle_states(tiny_model, read_records(out), tmp_path / "ref", layers, heldout_every=4)
    for split in ("train", "heldout"):
        got, want = load_split(cache, split), load_split(ref, split)
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.lengths, want.lengths)
        torch.testing.assert_close(got.hidden.float(), want.hidden.float(), rtol=0.02, atol=0.02)  # bf16
        last = got.starts[1:] - 1  # each record's last position
        keep = torch.ones(got.aux.shape[0], dtype=torch.bool)
        keep[last] = False
        torch.testing.assert_close(got.aux[keep].float(), want.aux[keep].float(), rtol=0.02, atol=0.02)
        ids = [i for i in range(12) if (i % 4 == 0) == (split == "heldout")]  # every 4th record held out
        generated = torch.tensor([i >= 3 for i in ids])  # records 0-2 were cached by the catch-up pass
        assert bool((got.aux[last[generated]] == 0).all()) and bool((got.aux[last[~generated]] != 0).any())
    with pytest.raises(ValueError, match="aux_layers"):
        generate_selfdistill(tiny_model, word_tokenizer, out, prompts, eagle_cache=cache)


def test_a_file_or_directory_specdec_did_not_write_is_never_appended_to_or_truncated(tiny_model, word_tokenizer,
                                                                                     tmp_path):
    prompts = [(0, chat_prompt_ids(word_tokenizer, "w1 w2"))]
    notes = tmp_path / "notes.txt"
    notes.write_text("line one\nno newline at the end")  # _drop_torn_tail would cut this last line
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "manifest.json").write_text('{"name": "my web app"}')
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(OutputPathError, match="notes.txt exists and is not a self-distillation jsonl"):
        generate_selfdistill(tiny_model, word_tokenizer, notes, prompts, max_new_tokens=4)
    with pytest.raises(OutputPathError, match="home is a directory"):
        generate_selfdistill(tiny_model, word_tokenizer, tmp_path / "home", prompts, max_new_tokens=4)
    with pytest.raises(OutputPathError, match="is not the manifest of a hidden-state cache"):
        generate_selfdistill(tiny_model, word_tokenizer, tmp_path / "sd.jsonl", prompts, max_new_tokens=4,
                             hidden_cache=tmp_path / "home")
    with pytest.raises(ValueError, match="notes.txt is not a self-distillation jsonl"):
        read_records(notes)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home", "notes.txt"]


def _entries(root) -> list[str]:
    """Every entry under `root`, directories marked with a trailing slash."""
    return sorted(str(p.relative_to(root)) + ("/" if p.is_dir() else "") for p in root.rglob("*"))


@pytest.mark.parametrize("case", ["no prompts", "deadline passed", "fails in its first batch"])
def test_a_run_that_writes_no_record_leaves_the_filesystem_as_it_was(tiny_model, word_tokenizer, tmp_path, case):
    """No empty jsonl, no empty cache, no parent directory made for them: the file and the caches
    are created with the first records."""
    prompts = [(i, chat_prompt_ids(word_tokenizer, f"w{i} w{i + 1}")) for i in range(3)]
    (tmp_path / "keep.txt").write_text("x")
    before = _entries(tmp_path)
    out = tmp_path / "new" / "data" / "sd.jsonl"
    args = dict(max_new_tokens=4, hidden_cache=tmp_path / "new" / "hidden", num_heads=2,
                eagle_cache=tmp_path / "new" / "eagle", aux_layers=(0, 1, 1))
    if case == "no prompts":
        assert generate_selfdistill(tiny_model, word_tokenizer, out, [], **args) == 0
    elif case == "deadline passed":
        assert generate_selfdistill(tiny_model, word_tokenizer, out, prompts, deadline=0.0, **args) == 0
    else:  # a layer the model does not have: found by the first batch's forward
        with pytest.raises(ValueError, match="aux_layers must be layer ids in 0..1"):
            generate_selfdistill(tiny_model, word_tokenizer, out, prompts, **{**args, "aux_layers": (0, 1, 9)})
    assert _entries(tmp_path) == before
    n = generate_selfdistill(tiny_model, word_tokenizer, out, prompts, **args)  # the same paths work afterwards
    assert n == 3 and json.loads((tmp_path / "new" / "eagle" / "manifest.json").read_text())["records_done"] == 3
    assert json.loads((tmp_path / "new" / "hidden" / "manifest.json").read_text())["records_done"] == 3
