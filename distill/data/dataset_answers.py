"""EAGLE-3 training records from ShareGPT's own answers, which the target reads teacher-forced.

Self-distillation (distill.data.selfdistill) makes the target write its answers token by token; a
written answer is read in one forward instead. For smollm2-135m-instruct in float32 on a 2-core
AVX2 CPU, 15 minutes gave 189k training positions this way against 83k by generation (with the
features kept from the generation itself). The head still learns the target's own next-token
distribution at every position (its soft targets come from the target's final states there); only
the text it reads is ShareGPT's, which is how EAGLE and EAGLE-2 trained their heads. The features
are cached with `distill.data.features.cache_eagle_states` and trained on beside the
self-distillation cache (`distill.train_eagle` with a list of caches).

Each record is {"id": "sharegpt-answer/<i>", "prompt_ids", "output_ids"}: the opening user turn of
calibration conversation i in the tokenizer's chat template (as self-distillation prompts are), and
the first assistant turn that follows it, up to the template's end-of-turn token (as a generated
answer ends), cut to `answer_tokens`. Conversations are read from the end of the calibration split
backwards, so they stay apart from the self-distillation prompts, which are read from its start.
"""

from __future__ import annotations

from pathlib import Path

import runtime.data
from distill.data.features import cache_eagle_states
from distill.data.selfdistill import chat_prompt_ids, opening_user_turn, stop_token_ids


def sharegpt_answer_records(tokenizer, limit: int, max_prompt_tokens: int = 256, answer_tokens: int = 256,
                            min_chars: int = 32) -> list[dict]:
    """Up to `limit` records (see the module docstring) from the last calibration conversations.

    A conversation is skipped when it does not open with a user turn of at least `min_chars`
    characters followed by an assistant turn, when its prompt exceeds `max_prompt_tokens`, or when
    the chat template does not render the answer after the prompt (prompt + answer must start with
    the prompt's own tokens, so the head reads what decoding will feed it).
    """
    if limit < 1 or answer_tokens < 1:
        raise ValueError(f"limit and answer_tokens must be >= 1, got {limit} and {answer_tokens}")
    convs = runtime.data.sharegpt_conversations(split="calibration")
    stops = set(stop_token_ids(tokenizer))
    out = []
    for i in range(len(convs) - 1, -1, -1):
        conv = convs[i]
        first = opening_user_turn(conv, min_chars)
        if first is None or len(conv) < 2 or conv[1]["role"] != "assistant":
            continue
        prompt = chat_prompt_ids(tokenizer, first)
        if len(prompt) > max_prompt_tokens:
            continue
        text = tokenizer.apply_chat_template(conv[:2], tokenize=False)
        full = tokenizer(text, add_special_tokens=False)["input_ids"]
        if full[:len(prompt)] != prompt or len(full) == len(prompt):
            continue
        answer = full[len(prompt):]
        end = next((j for j, t in enumerate(answer) if t in stops), len(answer) - 1)
        # up to the end of turn (ChatML templates add a newline after it, which decoding never reads)
        out.append({"id": f"sharegpt-answer/{i}", "prompt_ids": prompt,
                    "output_ids": answer[:end + 1][:answer_tokens]})
        if len(out) >= limit:
            break
    return out


def cache_answer_states(target, tokenizer, out_dir: str | Path, aux_layers: tuple[int, ...], limit: int,
                        answer_tokens: int = 256, max_prompt_tokens: int = 256,
                        deadline: float | None = None) -> Path:
    """The target's EAGLE-3 features over up to `limit` ShareGPT answers (`sharegpt_answer_records`),
    cached in `out_dir` (resumable; `deadline` a time.monotonic() value) with nothing held out: a
    head's held-out accuracy is measured on the target's own answers. Returns `out_dir`."""
    records = sharegpt_answer_records(tokenizer, limit=limit, max_prompt_tokens=max_prompt_tokens,
                                      answer_tokens=answer_tokens)
    return cache_eagle_states(target, records, out_dir, aux_layers, heldout_every=0, deadline=deadline)
