"""Self-distillation data: chat-template prompts, the model's own answers, resume."""

import json

import torch

import specdec
from distill.selfdistill import (chat_prompt_ids, generate_selfdistill, read_records,
                                 stop_token_ids)


def test_chat_prompt_and_stop_tokens(word_tokenizer):
    ids = chat_prompt_ids(word_tokenizer, "w1 w2")
    assert ids == word_tokenizer.convert_tokens_to_ids(
        ["<|im_start|>", "user", "w1", "w2", "<|im_end|>", "<|im_start|>", "assistant"])
    assert stop_token_ids(word_tokenizer) == [2]


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
