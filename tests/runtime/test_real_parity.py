"""Logit parity with transformers on real catalogue checkpoints: a prefill plus 32 greedy decode steps.

Fetched once through `runtime.fetch` (downloads on a fresh machine, offline once cached). Both
sides load the same bf16 safetensors in float32; the runtime decodes with its static KV cache,
transformers with its own cache, fed the same tokens.
"""

from __future__ import annotations

import pytest
import torch

import runtime

PROMPT = 'def quicksort(items: list[int]) -> list[int]:\n    """Sort a list of integers in ascending order."""\n'
DECODE_STEPS = 32
TOLERANCE = 1e-4  # max |difference| / max |logit|, per step


def _relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours - theirs).abs().max() / theirs.abs().max())


@pytest.mark.real_model
@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"])
def test_logits_match_transformers(name):
    from transformers import AutoModelForCausalLM

    ckpt = runtime.fetch(name)
    tokenizer = runtime.load_tokenizer(name)
    ours = runtime.load_model(name, dtype=torch.float32, weights="dense")
    theirs = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]  # (1, T)
    T = ids.shape[1]
    assert 15 <= T <= 40

    errors = []
    with torch.no_grad():
        cache = ours.new_cache(1, T + DECODE_STEPS)
        logits = ours(ids, torch.arange(T)[None], cache).logits  # (1, T, V)
        out = theirs(ids, use_cache=True)
        errors.append(_relative_error(logits, out.logits))
        past = out.past_key_values
        token = logits[:, -1:].argmax(-1)  # (1, 1)
        for step in range(DECODE_STEPS):
            logits = ours(token, torch.tensor([[T + step]]), cache).logits
            out = theirs(token, past_key_values=past, use_cache=True)
            errors.append(_relative_error(logits, out.logits))
            past = out.past_key_values
            token = logits[:, -1:].argmax(-1)
    assert int(cache.lengths[0]) == T + DECODE_STEPS
    worst = max(errors)
    assert worst <= TOLERANCE, f"{name}: worst step {errors.index(worst)} has relative error {worst:.2e}"
