"""EAGLE-3 training records from ShareGPT's own answers, which the target reads teacher-forced.

Self-distillation (distill.selfdistill) makes the target write its answers token by token; a
written answer is read in one forward instead. For smollm2-135m-instruct in float32 on a 2-core
AVX2 CPU, 15 minutes gave 189k training positions this way against 83k by generation (with the
features kept from the generation itself). The head still learns the target's own next-token
distribution at every position (its soft targets come from the target's final states there); only
the text it reads is ShareGPT's, which is how EAGLE and EAGLE-2 trained their heads. The features
are cached with `distill.eagle_cache.cache_eagle_states` and trained on beside the
self-distillation cache (`distill.train_eagle` with a list of caches).

Each record is {"id": "sharegpt-answer/<i>", "prompt_ids", "output_ids"}: the opening user turn of
calibration conversation i in the tokenizer's chat template (as self-distillation prompts are), and
the first assistant turn that follows it, up to the template's end-of-turn token (as a generated
answer ends), cut to `answer_tokens`. Conversations are read from the end of the calibration split backwards, so they
stay apart from the self-distillation prompts, which are read from its start.
"""

from __future__ import annotations

from distill.selfdistill import chat_prompt_ids, stop_token_ids


def sharegpt_answer_records(tokenizer, limit: int, max_prompt_tokens: int = 256, answer_tokens: int = 256,
                            min_chars: int = 32) -> list[dict]:
    """Up to `limit` records (see the module docstring) from the last calibration conversations.

    A conversation is skipped when it does not open with a user turn of at least `min_chars`
    characters followed by an assistant turn, when its prompt exceeds `max_prompt_tokens`, or when
    the chat template does not render the answer after the prompt (prompt + answer must start with
    the prompt's own tokens, so the head reads what decoding will feed it).
    """
    from runtime.data import sharegpt_conversations

    if limit < 1 or answer_tokens < 1:
        raise ValueError(f"limit and answer_tokens must be >= 1, got {limit} and {answer_tokens}")
    convs = sharegpt_conversations(split="calibration")
    stops = set(stop_token_ids(tokenizer))
    out = []
    for i in range(len(convs) - 1, -1, -1):
        conv = convs[i]
        if (len(conv) < 2 or conv[0]["role"] != "user" or conv[1]["role"] != "assistant"
                or len(conv[0]["content"].strip()) < min_chars):
            continue
        prompt = chat_prompt_ids(tokenizer, conv[0]["content"])
        if len(prompt) > max_prompt_tokens:
            continue
        text = tokenizer.apply_chat_template(conv[:2], tokenize=False)
        full = tokenizer(text, add_special_tokens=False)["input_ids"]
        if full[:len(prompt)] != prompt or len(full) == len(prompt):
            continue
        answer = full[len(prompt):]
        end = next((j for j, t in enumerate(answer) if t in stops), len(answer) - 1)
        # up to the end of turn (ChatML templates add a newline after it, which decoding never reads)
        out.append({"id": f"sharegpt-answer/{i}", "prompt_ids": prompt, "output_ids": answer[:end + 1][:answer_tokens]})
        if len(out) >= limit:
            break
    return out
