"""A sweep of bad arguments through every public entry point (specdec.generate / stream,
runtime.load_model / load_tokenizer / fetch / fetch_gguf): each raises TypeError or ValueError
before anything loads or runs, with a one-line message that starts by naming the argument; and
the checkers of runtime.args on their own."""

from __future__ import annotations

import pytest
import torch

import runtime
import specdec
from runtime.args import check_dtype, check_generator, check_int
from runtime.hardware import DTYPES
from runtime.tiny import tiny_model

IDS = torch.tensor([[5, 6, 7]])  # (B, T)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=0)  # vocabulary 128


GENERATE = {  # case -> (keyword arguments, the exception, the start of its message)
    "max_new_tokens float": (dict(max_new_tokens=2.5), TypeError, "max_new_tokens must be an integer >= 1, got 2.5"),
    "max_new_tokens str": (dict(max_new_tokens="8"), TypeError, "max_new_tokens must be an integer >= 1, got '8'"),
    "max_new_tokens bool": (dict(max_new_tokens=True), TypeError, "max_new_tokens must be an integer >= 1, got True"),
    "max_new_tokens -1": (dict(max_new_tokens=-1), ValueError, "max_new_tokens must be an integer >= 1, got -1"),
    "max_new_tokens 0": (dict(max_new_tokens=0), ValueError, "max_new_tokens must be an integer >= 1, got 0"),
    "num_draft_tokens 0": (dict(num_draft_tokens=0), ValueError, "num_draft_tokens must be an integer in [1, 64]"),
    "num_draft_tokens float": (dict(num_draft_tokens=2.5), ValueError, "num_draft_tokens must be an integer"),
    "temperature str": (dict(temperature="1"), ValueError, "temperature must be a finite number >= 0"),
    "temperature nan": (dict(temperature=float("nan")), ValueError, "temperature must be a finite number >= 0"),
    "top_p 0": (dict(top_p=0.0), ValueError, "top_p must be in (0, 1]"),
    "top_p str": (dict(top_p="0.5"), ValueError, "top_p must be in (0, 1]"),
    "top_k float": (dict(top_k=2.0), ValueError, "top_k must be an integer >= 0"),
    "top_k -1": (dict(top_k=-1), ValueError, "top_k must be an integer >= 0"),
    "streamer": (dict(streamer=object()), TypeError, "streamer must be a transformers-style streamer"),
    "generator int": (dict(generator=42), TypeError, "generator must be a torch.Generator or None, got 42 (int)"),
    "observer": (dict(observer=object()), TypeError, "observer must be a specdec.capture.DecodeObserver"),
    "observer in a list": (dict(observer=[object()]), TypeError, "observer must be a specdec.capture.DecodeObserver"),
    "eos_token_id str": (dict(eos_token_id="108"), ValueError, "eos_token_id must be a token id"),
    "eos_token_id negative": (dict(eos_token_id=-1), ValueError, "eos_token_id must hold token ids >= 0"),
    "pad_token_id str": (dict(pad_token_id="0"), TypeError, "pad_token_id must be an integer >= 0 or None"),
    "pad_token_id negative": (dict(pad_token_id=-1), ValueError, "pad_token_id must be an integer >= 0 or None"),
    "attention_mask list": (dict(attention_mask=[[1, 1, 1]]), TypeError, "attention_mask must be a tensor"),
    "attention_mask shape": (dict(attention_mask=torch.ones(1, 2)), ValueError, "attention_mask has shape (1, 2)"),
    "attention_mask values": (dict(attention_mask=torch.tensor([[2, 1, 1]])), ValueError,
                              "attention_mask must hold only 0 (padding) and 1 (token)"),
    "attention_mask hole": (dict(attention_mask=torch.tensor([[1, 0, 1]])), ValueError,
                            "attention_mask row 0 has padding between"),
    "attention_mask meta": (dict(attention_mask=torch.ones(1, 3, device="meta")), ValueError,
                            "attention_mask is on the meta device"),
    "input_ids meta": (dict(input_ids=torch.ones(1, 3, dtype=torch.long, device="meta")), ValueError,
                       "input_ids is on the meta device"),
    "input_ids float": (dict(input_ids=torch.tensor([[5.0, 6.0]])), ValueError,
                        "input_ids must hold integer token ids"),
    "input_ids bool": (dict(input_ids=torch.tensor([[True]])), ValueError, "input_ids must hold integer token ids"),
    "input_ids 3-D": (dict(input_ids=torch.ones(1, 1, 3, dtype=torch.long)), ValueError,
                      "input_ids must be a LongTensor [B, T]"),
    "input_ids 0-D": (dict(input_ids=torch.tensor(5)), ValueError, "input_ids must be a LongTensor [B, T]"),
    "input_ids no tokens": (dict(input_ids=torch.ones(1, 0, dtype=torch.long)), ValueError,
                            "input_ids row 0 is empty"),
    "input_ids no rows": (dict(input_ids=torch.ones(0, 3, dtype=torch.long)), ValueError, "input_ids holds no rows"),
    "input_ids out of vocabulary": (dict(input_ids=torch.tensor([[5, 900]])), ValueError,
                                    "input_ids row 0 holds token id 900, outside the model's vocabulary [0, 128)"),
    "input_ids negative": (dict(input_ids=torch.tensor([[5, -3]])), ValueError, "input_ids row 0 holds token id -3"),
    "input_ids str": (dict(input_ids="hello"), TypeError, "input_ids must be a LongTensor [B, T]"),
    "input_ids list of ints": (dict(input_ids=[5, 6]), ValueError, "input_ids[0] must be 1-D"),
    "input_ids list of floats": (dict(input_ids=[torch.tensor([5.0])]), ValueError,
                                 "input_ids[0] must hold integer token ids"),
    "input_ids list of str": (dict(input_ids=["hello"]), TypeError, "input_ids[0] must be a 1-D LongTensor"),
    "input_ids empty list": (dict(input_ids=[]), ValueError, "input_ids is an empty list"),
    "input_ids list with a mask": (dict(input_ids=[torch.tensor([5])], attention_mask=torch.ones(1, 1)), ValueError,
                                   "attention_mask goes with a (B, T) tensor"),
    "target path": (dict(target="path/to/ckpt"), TypeError,
                    "target must be a loaded model, got the path or name 'path/to/ckpt'; load it first: "
                    "runtime.load_model('path/to/ckpt')"),
    "target None": (dict(target=None), TypeError, "target must be a runtime model (runtime.load_model)"),
    "draft int": (dict(draft=42), TypeError, "draft must be None, a drafter spec"),
}


def _argument(start: str) -> str:
    """The argument a message starts by naming ("input_ids[0]" names input_ids)."""
    return start.split()[0].split("[")[0]


def _raises(call, error: type, start: str) -> None:
    with pytest.raises(error) as err:
        call()
    text = str(err.value)
    assert text.startswith(start), text
    assert "\n" not in text and _argument(start) in text


@pytest.mark.parametrize("case", list(GENERATE))
def test_generate_refuses_a_bad_argument_by_name(model, case):
    kwargs, error, start = GENERATE[case]
    kwargs = {"target": model, "input_ids": IDS, "max_new_tokens": 2, **kwargs}
    _raises(lambda: specdec.generate(**kwargs), error, start)


STREAM = ["max_new_tokens float", "max_new_tokens 0", "num_draft_tokens 0", "generator int", "top_p 0",
          "eos_token_id str", "target path", "input_ids meta", "input_ids empty list"]


@pytest.mark.parametrize("case", STREAM)
def test_stream_refuses_a_bad_argument_at_the_call(model, case):
    """stream() checks its arguments when called, not when its iterator is first read."""
    kwargs, error, start = GENERATE[case]
    kwargs = {"target": model, "input_ids": IDS, "max_new_tokens": 2, **kwargs}
    _raises(lambda: specdec.stream(**kwargs), error, start)


LOAD = {  # case -> (keyword arguments of load_model, the exception, the start of its message)
    "name_or_path int": (dict(name_or_path=42), TypeError, "name_or_path must be a catalogue name"),
    "name_or_path None": (dict(name_or_path=None), TypeError, "name_or_path must be a catalogue name"),
    "name_or_path empty": (dict(name_or_path=""), ValueError, "name_or_path is empty"),
    "dtype int8": (dict(dtype=torch.int8), ValueError,
                   "dtype must be one of torch.bfloat16, torch.float32, torch.float16 (or their names: bfloat16, "
                   "float32, float16), got torch.int8"),
    "dtype float8 name": (dict(dtype="float8"), ValueError, "dtype must be one of torch.bfloat16"),
    "dtype int": (dict(dtype=8), TypeError, "dtype must be one of torch.bfloat16"),
    "device unknown": (dict(device="banana"), ValueError, "unknown device 'banana'"),
    "device absent": (dict(device="cuda:7"), ValueError, "device 'cuda:7'"),
    "attention": (dict(attention="flash"), ValueError, "attention must be 'sdpa' or 'triton'"),
    "weights": (dict(weights="int4"), ValueError, "weights must be one of"),
    "compile str": (dict(compile="yes"), TypeError, "compile must be True or False"),
    "row_invariant int": (dict(row_invariant=1), TypeError, "row_invariant must be True or False"),
}


@pytest.mark.parametrize("case", list(LOAD))
def test_load_model_refuses_a_bad_argument_before_reading_anything(tmp_path, case):
    """The checkpoint named does not exist: the argument's error comes first."""
    kwargs, error, start = LOAD[case]
    kwargs = {"name_or_path": tmp_path / "nowhere", **kwargs}
    _raises(lambda: runtime.load_model(**kwargs), error, start)


@pytest.mark.parametrize("call", [runtime.load_tokenizer, lambda v: runtime.fetch(v), lambda v: runtime.fetch_gguf(v)],
                         ids=["load_tokenizer", "fetch", "fetch_gguf"])
def test_a_name_that_is_no_str_is_a_type_error(call):
    with pytest.raises(TypeError, match=r"^(name_or_path|name) must be .* got 42 \(int\)$"):
        call(42)


def test_checkers_take_what_they_accept():
    import numpy as np

    assert check_int("n", np.int64(3), minimum=1) == 3 and type(check_int("n", np.int64(3))) is int
    assert check_int("n", None, optional=True) is None
    assert check_dtype("dtype", "float32", DTYPES) is torch.float32
    assert check_dtype("dtype", torch.bfloat16, DTYPES) is torch.bfloat16
    check_generator("generator", torch.Generator(), torch.device("cpu"))


def test_a_generator_on_another_device_is_named_with_the_fix():
    """The device comparison alone (this machine need not have the GPU): "cuda" is "cuda:0"."""
    with pytest.raises(ValueError, match=r"^generator is on cpu but the model runs on cuda:0; create it with "
                                         r"torch.Generator\(device='cuda:0'\)$"):
        check_generator("generator", torch.Generator(), torch.device("cuda:0"))


def test_a_dtype_name_loads_like_the_dtype(tiny_llama, tmp_path):
    tiny_llama.save_pretrained(tmp_path)
    assert runtime.load_model(tmp_path, dtype="float32").embed.weight.dtype == torch.float32
