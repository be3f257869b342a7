"""The OpenAI wire format of specdec serve without a server: stop strings cut the streamed text
exactly where the whole text would be cut, whatever the token boundaries; n, stop and seed are checked,
and a field the server does not know is refused by name."""

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from specdec.serving.protocol import APIError, IncrementalText, parse_chat, parse_completion

MODEL = "m"


@pytest.fixture(scope="module")
def chars() -> PreTrainedTokenizerFast:
    """One token per character (a-z, space, "."), so every split point of a text can be tested."""
    alphabet = "abcdefghijklmnopqrstuvwxyz ."
    tk = Tokenizer(models.WordLevel({c: i for i, c in enumerate(["<unk>", *alphabet])}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tk.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", clean_up_tokenization_spaces=False)


def _ids(tok, text: str) -> list[int]:
    return [tok.convert_tokens_to_ids(c) for c in text]


def _streamed(tok, ids: list[int], stop: tuple[str, ...], step: int) -> tuple[str, bool]:
    text, out = IncrementalText(tok, stop), []
    for i in range(0, len(ids), step):
        out.append(text.add(ids[i:i + step], i + step >= len(ids)))
    return "".join(out), text.stopped


@pytest.mark.parametrize("step", [1, 2, 3, 7])
def test_stop_strings_cut_the_stream_at_the_first_one_whatever_the_steps(chars, step):
    text = "the cat sat. then the dog ran away."
    ids = _ids(chars, text)
    assert chars.decode(ids) == text
    assert _streamed(chars, ids, (), step) == (text, False)
    assert _streamed(chars, ids, ("dog", "sat."), step) == ("the cat ", True)
    assert _streamed(chars, ids, ("zebra", "ran"), step) == ("the cat sat. then the dog ", True)
    # a tail that starts a stop string but never completes it is sent at the end
    assert _streamed(chars, ids, ("away!",), step) == (text, False)


def test_text_and_token_count_end_at_the_token_that_completes_the_stop_string(chars):
    text = "the cat sat. then the dog ran away."
    for step in (1, 4, len(text)):
        inc = IncrementalText(chars, ("dog", "sat."))
        ids = _ids(chars, text)
        for i in range(0, len(ids), step):
            inc.add(ids[i:i + step], False)
        assert (inc.text, inc.tokens, inc.stopped) == ("the cat ", len("the cat sat."), True)
    whole = IncrementalText(chars)
    whole.extend(_ids(chars, text[:10]))
    assert whole.add(_ids(chars, text[10:]), True) == text and (whole.text, whole.tokens) == (text, len(text))


def test_a_held_back_tail_is_not_sent_until_it_cannot_be_a_stop_string(chars):
    text = IncrementalText(chars, ("cats",))
    assert text.add(_ids(chars, "a ca"), False) == "a "
    assert text.add(_ids(chars, "t"), False) == ""
    assert text.add(_ids(chars, "e"), False) == "cate"
    assert text.add(_ids(chars, " cats and"), False) == " " and text.stopped
    assert text.add(_ids(chars, "more"), True) == ""


def _body(**kw) -> dict:
    return {"model": MODEL, "prompt": [1, 2], **kw}


def test_n_and_stop_are_parsed_and_checked(chars):
    req = parse_completion(_body(n=3, stop="."), MODEL, chars, 30)
    assert (req.n, req.stop) == (3, (".",))
    assert parse_completion(_body(stop=["a", "b", "a"]), MODEL, chars, 30).stop == ("a", "b")
    assert parse_completion(_body(), MODEL, chars, 30).n == 1
    for bad, param, code in [(dict(n=0), "n", "invalid_value"), (dict(n=17), "n", "invalid_value"),
                             (dict(n="2"), "n", "invalid_type"), (dict(stop=[1]), "stop", "invalid_type"),
                             (dict(stop=["a"] * 5), "stop", "invalid_value"), (dict(stop=""), "stop", "invalid_value"),
                             (dict(best_of=3), "best_of", "unsupported_parameter")]:
        with pytest.raises(APIError) as err:
            parse_completion(_body(**bad), MODEL, chars, 30)
        assert (err.value.status, err.value.param, err.value.code) == (400, param, code)


@pytest.mark.parametrize("field,value,code", [
    ("foo", 1, "unknown_parameter"),
    ("stop_token_ids", [999], "unknown_parameter"),  # vLLM's extension: not taken here, so not ignored
    ("messages", [{"role": "user", "content": "a"}], "unknown_parameter"),  # a chat field on /v1/completions
    ("seed", -1, "invalid_value"),
    ("seed", 2 ** 70, "invalid_value"),
    ("seed", 2 ** 63, "invalid_value"),
    ("seed", 1.5, "invalid_type"),
    ("tool_choice", "auto", "unsupported_parameter"),
    ("temperature", 1e-45, "invalid_value"),  # nonzero, but logits / temperature overflow float32
    ("top_p", 1e-300, "invalid_value"),  # rounds to 0 in float32: no token would be kept
])
def test_unknown_fields_and_seeds_out_of_range_are_refused_by_name(chars, field, value, code):
    with pytest.raises(APIError) as err:
        parse_completion(_body(**{field: value}), MODEL, chars, 30)
    assert (err.value.status, err.value.param, err.value.code) == (400, field, code)
    assert repr(field) in err.value.message or f"'{field}'" in err.value.message


def test_chat_refuses_a_completions_field_and_both_take_the_openai_defaults_and_user(chars, monkeypatch):
    monkeypatch.setattr(chars, "chat_template", "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "ab"}]}
    with pytest.raises(APIError) as err:
        parse_chat({**chat, "prompt": "ab"}, MODEL, chars)
    assert (err.value.param, err.value.code) == ("prompt", "unknown_parameter")
    defaults = dict(user="u1", logprobs=False, presence_penalty=0, tool_choice="none", seed=2 ** 63 - 1)
    assert parse_chat({**chat, **defaults}, MODEL, chars).seed == 2 ** 63 - 1
    assert parse_completion(_body(**defaults), MODEL, chars, 30).prompt_ids == (1, 2)


def test_each_step_decodes_only_the_ids_since_the_step_before(chars):
    text = "the cat sat. then the dog ran away. " * 20
    inc, decoded = IncrementalText(chars, ("zebra",)), []
    decode = chars.decode
    chars.decode = lambda ids, **kw: decoded.append(len(ids)) or decode(ids, **kw)
    try:
        out = [inc.add([i], False) for i in _ids(chars, text)]
    finally:
        del chars.decode
    assert "".join(out) + inc.add([], True) == text == inc.text
    assert max(decoded) <= 2  # not the whole list: a stream of T tokens decodes O(T) ids in all


@pytest.mark.real_model
@pytest.mark.parametrize("step", [1, 2, 5])
def test_streamed_text_equals_the_whole_decode_with_a_real_tokenizer(step):
    import runtime

    tok = runtime.load_tokenizer("smollm2-135m-instruct")
    text = ("Grüße aus Köln! 東京は晴れ 🌞🎉  def f(x):\n    return x ** 2  # “quoted”\n"
            "<|im_end|> and then   spaces,\ttabs and ünïcödé.")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > 40
    for stop in ((), ("ünï",), ("🎉",)):
        whole = tok.decode(ids, skip_special_tokens=True)
        inc, out = IncrementalText(tok, stop), []
        for i in range(0, len(ids), step):
            out.append(inc.add(ids[i:i + step], i + step >= len(ids)))
        want = whole[:whole.find(stop[0])] if stop else whole
        assert "".join(out) == inc.text == want


def test_ids_without_text_do_not_cut_the_next_tokens_leading_space():
    """SentencePiece-style decoding drops the leading space of a sequence's first token: a step that
    adds only skipped special tokens must not become the window the next token is decoded after."""
    vocab = {"<unk>": 0, "<s>": 1, "▁hello": 2, "▁world": 3}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.decoder = decoders.Metaspace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", additional_special_tokens=["<s>"])
    assert tok.decode([2, 1, 3], skip_special_tokens=True) == "hello world"
    inc = IncrementalText(tok)
    assert "".join([inc.add([2], False), inc.add([1], False), inc.add([3], False), inc.add([], True)]) == "hello world"
