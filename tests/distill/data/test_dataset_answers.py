"""ShareGPT's own answers as EAGLE-3 records: which conversations are read, and how they are cut."""

import pytest

import runtime.data
from distill.data.dataset_answers import sharegpt_answer_records
from distill.data.selfdistill import chat_prompt_ids

LONG = "w1 " * 12  # a user turn of at least 32 characters


def _conversations():
    return [
        [{"role": "user", "content": LONG + "w2"}, {"role": "assistant", "content": "w3 w4 w5"}],
        [{"role": "assistant", "content": "w6 w7"}, {"role": "user", "content": LONG}],  # a continuation
        [{"role": "user", "content": "w8"}, {"role": "assistant", "content": "w9"}],  # "continue"-short
        [{"role": "user", "content": LONG + "w10"}],  # no answer
        [{"role": "user", "content": LONG + "w11 " * 40}, {"role": "assistant", "content": "w12"}],  # long prompt
        [{"role": "user", "content": LONG + "w13"}, {"role": "assistant", "content": "w14 w15 w16 w17 w18"},
         {"role": "user", "content": LONG}],
    ]


@pytest.fixture
def conversations(monkeypatch):
    monkeypatch.setattr(runtime.data, "sharegpt_conversations", lambda split, limit=None: _conversations())


def test_answers_are_read_from_the_end_of_the_calibration_split(word_tokenizer, conversations):
    records = sharegpt_answer_records(word_tokenizer, limit=10, max_prompt_tokens=30, answer_tokens=64)
    assert [r["id"] for r in records] == ["sharegpt-answer/5", "sharegpt-answer/0"]
    last = records[0]
    assert last["prompt_ids"] == chat_prompt_ids(word_tokenizer, LONG + "w13")
    answer = word_tokenizer.convert_tokens_to_ids(["w14", "w15", "w16", "w17", "w18", "<|im_end|>"])
    assert last["output_ids"] == answer  # the first assistant turn only, ending with the end of turn


def test_answers_are_cut_and_counted(word_tokenizer, conversations):
    records = sharegpt_answer_records(word_tokenizer, limit=1, max_prompt_tokens=30, answer_tokens=3)
    assert len(records) == 1 and records[0]["output_ids"] == word_tokenizer.convert_tokens_to_ids(["w14", "w15", "w16"])
    assert len(sharegpt_answer_records(word_tokenizer, limit=10, max_prompt_tokens=60)) == 3  # the long prompt too
    with pytest.raises(ValueError, match="limit and answer_tokens must be >= 1"):
        sharegpt_answer_records(word_tokenizer, limit=0)


@pytest.mark.real_model
def test_a_chatml_answer_ends_at_its_end_of_turn_token(conversations):
    import runtime

    tok = runtime.load_tokenizer("smollm2-135m-instruct")
    records = sharegpt_answer_records(tok, limit=1, max_prompt_tokens=256)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert records[0]["output_ids"][-1] == end and records[0]["output_ids"].count(end) == 1  # no newline after
    assert tok.decode(records[0]["output_ids"], skip_special_tokens=True) == "w14 w15 w16 w17 w18"
