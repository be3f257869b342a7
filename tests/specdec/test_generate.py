"""Plain decoding through specdec.generate: parity with transformers, batches, stopping, errors."""

import pytest
import torch

import specdec
from runtime.errors import ContextLengthError
from runtime.tiny import tiny_pair
from specdec.capture import StateCapture


@pytest.fixture(scope="module")
def pair():
    return tiny_pair("llama", seed=0)


def _prompts(lengths, seed=0, vocab=128):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


def test_greedy_equals_transformers_generate(pair):
    model, hf = pair
    ids = torch.stack(_prompts([10, 10], seed=1))
    out = specdec.generate(model, ids, max_new_tokens=24)
    ref = hf.generate(ids, max_new_tokens=24, do_sample=False, attention_mask=torch.ones_like(ids))
    assert torch.equal(out.sequences, ref)
    assert out.stats.mean_accepted_tokens == 1.0
    assert out.stats.generated_tokens == 48 and out.stats.target_forwards == 48
    assert out.stats.ttft_s > 0 and out.stats.tokens_per_second > 0


def test_rows_of_different_lengths_equal_rows_decoded_alone(pair):
    model, _ = pair
    rows = _prompts([3, 11, 6], seed=2)
    batch = specdec.generate(model, rows, max_new_tokens=16).sequences
    assert isinstance(batch, list)
    for r, s in zip(rows, batch):
        assert torch.equal(s, specdec.generate(model, [r], max_new_tokens=16).sequences[0])


def test_sampling_is_reproducible_with_a_generator_and_respects_top_k(pair):
    model, _ = pair
    rows = _prompts([4, 7], seed=3)
    kw = dict(max_new_tokens=12, temperature=0.9, top_k=1)
    a = specdec.generate(model, rows, generator=torch.Generator().manual_seed(5), **kw).sequences
    greedy = specdec.generate(model, rows, max_new_tokens=12).sequences
    assert all(torch.equal(x, y) for x, y in zip(a, greedy))  # top_k=1 is greedy
    kw["top_k"] = 0
    b = specdec.generate(model, rows, generator=torch.Generator().manual_seed(5), **kw).sequences
    c = specdec.generate(model, rows, generator=torch.Generator().manual_seed(5), **kw).sequences
    d = specdec.generate(model, rows, generator=torch.Generator().manual_seed(6), **kw).sequences
    assert all(torch.equal(x, y) for x, y in zip(b, c))
    assert not all(torch.equal(x, y) for x, y in zip(b, d))


def test_each_row_stops_at_its_own_eos(pair):
    model, _ = pair
    rows = _prompts([5, 8], seed=4)
    free = specdec.generate(model, rows, max_new_tokens=20).sequences
    eos_a = int(free[0][5 + 3])  # row 0's 4th new token
    eos_b = int(free[1][8 + 6])  # row 1's 7th new token
    out = specdec.generate(model, rows, max_new_tokens=20, eos_token_id=[eos_a, eos_b]).sequences
    for r, s, f in zip(rows, out, free):
        new = s[r.numel():].tolist()
        first = next(i for i, t in enumerate(f[r.numel():].tolist()) if t in (eos_a, eos_b))
        assert new == f[r.numel():r.numel() + first + 1].tolist()


def test_max_new_tokens_bounds_and_zero_is_refused_as_in_transformers(pair):
    model, _ = pair
    rows = _prompts([4], seed=5)
    assert specdec.generate(model, rows, max_new_tokens=7).sequences[0].numel() == 11
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1, got 0"):
        specdec.generate(model, rows, max_new_tokens=0)


def test_a_transformers_model_works_through_the_adapter(pair):
    model, hf = pair
    rows = _prompts([4, 9], seed=6)
    ours = specdec.generate(model, rows, max_new_tokens=10).sequences
    theirs = specdec.generate(hf, rows, max_new_tokens=10).sequences
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


@pytest.mark.parametrize("draft", [None, "ngram", "self"])
def test_hidden_states_are_those_behind_each_new_token(pair, draft):
    """Plain or speculative: the states of each row's accepted path, cut where the row stops."""
    model, _ = pair
    rows = _prompts([5, 8, 3], seed=7)
    free = specdec.generate(model, rows, max_new_tokens=9).sequences
    eos = int(free[1][8 + 2])  # row 1 stops after 3 new tokens, the others run to 9
    capture = StateCapture(hidden=True)
    out = specdec.generate(model, rows, draft=model if draft == "self" else draft, max_new_tokens=9,
                           eos_token_id=eos, observer=capture, num_draft_tokens=3)
    for r, s, h in zip(rows, out.sequences, capture.hidden_states):
        new = s.numel() - r.numel()
        assert h.shape == (new, model.config.hidden_size)
        ref = model(s[None], torch.arange(s.numel())[None], None, return_hidden=True).hidden  # (1, T, C)
        torch.testing.assert_close(h, ref[0, r.numel() - 1:s.numel() - 1], rtol=1e-4, atol=1e-4)
    assert [h.shape[0] for h in capture.hidden_states] != [9, 9, 9]  # the stopped row is cut
    unasked = StateCapture(aux_layers=(0,))
    specdec.generate(model, rows, max_new_tokens=9, observer=unasked)
    assert unasked.hidden_states is None


@pytest.mark.parametrize("draft", [None, "ngram", "self"])
def test_aux_states_are_those_of_one_forward_over_every_position_the_target_read(pair, draft):
    """Plain or speculative, ragged rows, one stopped early: the states entering the aux layers at the
    prompt and every new token but the last, as one forward of the whole sequence computes them."""
    model, _ = pair
    layers = (1, 0, 1)  # the tiny model has 2 layers; any order, repeats allowed
    rows = _prompts([5, 8, 3], seed=7)
    free = specdec.generate(model, rows, max_new_tokens=9).sequences
    eos = int(free[1][8 + 2])  # row 1 stops after 3 new tokens, the others run to 9
    capture = StateCapture(aux_layers=layers)
    out = specdec.generate(model, rows, draft=model if draft == "self" else draft, max_new_tokens=9,
                           eos_token_id=eos, num_draft_tokens=3, observer=capture)
    C = model.config.hidden_size
    for s, a in zip(out.sequences, capture.aux_states):
        assert a.shape == (s.numel() - 1, 3 * C)
        ref = model(s[None], torch.arange(s.numel())[None], None, aux_layers=layers).aux  # (1, T, 3C)
        torch.testing.assert_close(a, ref[0, :-1], rtol=1e-4, atol=1e-4)
    assert [a.shape[0] for a in capture.aux_states] != [s.numel() + 8 for s in rows]  # the stopped row is cut
    unasked = StateCapture(hidden=True)
    specdec.generate(model, rows, max_new_tokens=9, observer=unasked)
    assert unasked.aux_states is None


def test_bad_requests_fail_with_clear_messages(pair):
    model, _ = pair
    with pytest.raises(ValueError, match="empty"):
        specdec.generate(model, [torch.tensor([], dtype=torch.long)])
    with pytest.raises(ContextLengthError, match="exceeds the model's 512 positions"):
        specdec.generate(model, torch.zeros(1, 500, dtype=torch.long), max_new_tokens=20)
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        specdec.generate(model, torch.tensor([[5, 900]]))
    with pytest.raises(ValueError, match="temperature"):
        specdec.generate(model, torch.tensor([[5]]), temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        specdec.generate(model, torch.tensor([[5]]), top_p=0.0)
    for t in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="temperature must be a finite number"):
            specdec.generate(model, torch.tensor([[5]]), temperature=t)
    with pytest.raises(ValueError, match="eos_token_id must be a token id"):
        specdec.generate(model, torch.tensor([[5]]), eos_token_id="108")  # not the digits 1, 0, 8


@pytest.mark.parametrize("kwargs, error, first", [
    (dict(eos_token_id=10**6), ValueError, "eos_token_id 1000000 is outside the model's vocabulary [0, 128)"),
    (dict(eos_token_id=[3, 128]), ValueError, "eos_token_id 128 is outside the model's vocabulary [0, 128)"),
    (dict(num_draft_tokens="3"), TypeError, "num_draft_tokens must be an integer in [1, 64] or 'auto', got '3' (str); "
                                            "pass 3, an int"),
    (dict(num_draft_tokens="many", draft="ngram@2"), TypeError, "num_draft_tokens must be an integer in [1, 64]"),
    (dict(num_draft_tokens=0), ValueError, "num_draft_tokens must be an integer in [1, 64]"),
])
def test_out_of_vocabulary_stops_and_text_draft_lengths_are_refused(pair, kwargs, error, first):
    model, _ = pair
    with pytest.raises(error) as err:
        specdec.generate(model, torch.tensor([[5, 6]]), max_new_tokens=2, **kwargs)
    assert str(err.value).startswith(first)


def test_auto_and_the_last_token_id_are_accepted(pair):
    model, _ = pair
    out = specdec.generate(model, torch.tensor([[5, 6]]), max_new_tokens=3, draft="ngram", num_draft_tokens="auto",
                           eos_token_id=127)
    assert out.sequences.shape[0] == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device to hold the input ids")
def test_input_ids_on_another_device_than_the_model_are_refused(pair):
    model, _ = pair  # on the CPU
    with pytest.raises(ValueError, match=r"^input_ids is on cuda:0 but the model runs on cpu; move them"):
        specdec.generate(model, torch.tensor([[5, 6]], device="cuda"), max_new_tokens=2)


def test_a_tokenizers_output_is_taken_as_its_input_ids_and_attention_mask(pair):
    """A BatchEncoding (what `tokenizer(...)` and `apply_chat_template(..., return_dict=True)` return)
    decodes as its input_ids with its attention_mask; an explicit attention_mask wins."""
    from transformers import BatchEncoding

    model, _ = pair
    rows = _prompts([6, 3], seed=3)
    alone = specdec.generate(model, rows, max_new_tokens=5).sequences
    batch = torch.zeros(2, 6, dtype=torch.long)
    mask = torch.zeros(2, 6, dtype=torch.long)
    for b, r in enumerate(rows):
        batch[b, 6 - r.numel():], mask[b, 6 - r.numel():] = r, 1  # left-padded, as tokenizers pad for generation
    out = specdec.generate(model, BatchEncoding({"input_ids": batch, "attention_mask": mask}), max_new_tokens=5,
                           pad_token_id=0).sequences
    for b, seq in enumerate(alone):
        assert torch.equal(out[b, :seq.numel()], seq)  # rows come back unpadded on the left
    one = specdec.generate(model, BatchEncoding({"input_ids": rows[0][None]}), max_new_tokens=5).sequences
    assert torch.equal(one[0], alone[0])
    lists = [r.tolist() for r in rows]  # a tokenizer called without return_tensors: lists of ids
    got = specdec.generate(model, BatchEncoding({"input_ids": lists, "attention_mask": [[1] * len(r) for r in lists]}),
                           max_new_tokens=5).sequences
    assert all(torch.equal(a, b) for a, b in zip(got, alone, strict=True))
    assert torch.equal(specdec.generate(model, BatchEncoding({"input_ids": lists[0]}), max_new_tokens=5).sequences[0],
                       alone[0])
    padded = specdec.generate(model, BatchEncoding({"input_ids": batch.tolist(), "attention_mask": mask.tolist()}),
                              max_new_tokens=5, pad_token_id=0).sequences
    assert torch.equal(padded, out)
    with pytest.raises(TypeError, match="without an 'input_ids' entry"):
        specdec.generate(model, {"ids": batch}, max_new_tokens=5)
    ones = torch.ones_like(mask)  # the caller's mask wins over the encoding's: the padding is read as prompt
    given = specdec.generate(model, {"input_ids": batch, "attention_mask": mask}, attention_mask=ones, max_new_tokens=5,
                             pad_token_id=0).sequences
    assert torch.equal(given, specdec.generate(model, batch, attention_mask=ones, max_new_tokens=5,
                                               pad_token_id=0).sequences)


def test_a_padded_batch_takes_its_attention_mask_or_is_refused(pair):
    model, _ = pair
    rows = _prompts([6, 3], seed=3)
    alone = specdec.generate(model, rows, max_new_tokens=5).sequences
    pad = 0
    batch = torch.full((2, 6), pad)
    mask = torch.zeros(2, 6, dtype=torch.long)
    for b, r in enumerate(rows):  # right-padded
        batch[b, :r.numel()], mask[b, :r.numel()] = r, 1
    with pytest.raises(ValueError, match="attention_mask"):
        specdec.generate(model, batch, max_new_tokens=5, pad_token_id=pad)
    out = specdec.generate(model, batch, attention_mask=mask, max_new_tokens=5, pad_token_id=pad).sequences
    for b, seq in enumerate(alone):
        assert torch.equal(out[b, :seq.numel()], seq)


def _padded(rows: list[torch.Tensor], pad: int, width: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """rows padded with `pad` to `width` on the left or the right -> (ids, attention_mask), (B, width) each."""
    ids, mask = torch.full((len(rows), width), pad), torch.zeros(len(rows), width, dtype=torch.long)
    for b, r in enumerate(rows):
        cols = slice(width - r.numel(), width) if left else slice(0, r.numel())
        ids[b, cols], mask[b, cols] = r, 1
    return ids, mask


@pytest.mark.parametrize("shape", ["(1, T)", "(T,)", "(2, T)"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_without_a_mask_is_refused_for_one_row_too(pair, shape, side):
    """A prompt padded to a fixed length (padding="max_length") without its mask is refused however many
    rows it has; with the mask every row decodes as it does alone."""
    model, _ = pair
    pad = 0
    rows = [p.clamp(min=1) for p in _prompts([3, 5], seed=8)]  # no pad inside a prompt
    ids, mask = _padded(rows if shape == "(2, T)" else rows[:1], pad, width=7, left=side == "left")
    if shape == "(T,)":
        ids, mask = ids[0], mask[0]
    with pytest.raises(ValueError, match=f"^input_ids row 0 starts or ends with pad_token_id {pad} but no "
                                         "attention_mask says which tokens are padding: pass attention_mask"):
        specdec.generate(model, ids, max_new_tokens=4, pad_token_id=pad)
    out = specdec.generate(model, ids, attention_mask=mask, max_new_tokens=4, pad_token_id=pad).sequences
    assert out.shape[0] == (2 if shape == "(2, T)" else 1)
    for b, r in enumerate(rows[:out.shape[0]]):
        alone = specdec.generate(model, [r], max_new_tokens=4).sequences[0]
        assert torch.equal(out[b, :alone.numel()], alone)


def test_a_pad_token_inside_a_prompt_is_a_token(pair):
    """pad_token_id between real tokens (a chat whose end-of-turn token is also the pad) is no padding:
    the rows decode as the same prompts given as a list."""
    model, _ = pair
    rows = _prompts([6, 6], seed=9)
    for r in rows:
        r[0], r[2], r[-1] = 3, 0, 4  # the pad 0 inside, not at either end
    out = specdec.generate(model, torch.stack(rows), max_new_tokens=5, pad_token_id=0).sequences
    ref = specdec.generate(model, rows, max_new_tokens=5).sequences
    assert all(torch.equal(a, b) for a, b in zip(out, ref))


def test_nan_logits_fail_fast_with_a_named_error():
    from runtime.tiny import tiny_model
    from specdec.sampling import NonFiniteLogitsError

    broken = tiny_model("llama", seed=9)
    with torch.no_grad():
        broken.layers[1].mlp.w2.weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteLogitsError, match="NaN logits"):
        specdec.generate(broken, torch.tensor([[1, 2, 3]]), max_new_tokens=4)
    with pytest.raises(NonFiniteLogitsError, match="NaN logits"):
        specdec.generate(broken, torch.tensor([[1, 2, 3]]), draft="ngram", max_new_tokens=4)


@pytest.mark.real_model
def test_bf16_speculative_output_equals_plain_on_real_prompts():
    """Real smollm2 in bf16, eager: with the row-invariant kernels n-gram drafting gives plain
    decoding's tokens on every prompt of a batch, and each row equals its prompt decoded alone
    (with the batch-dependent kernels, 4 of these 8 differed)."""
    import runtime
    from tests.specdec.serving.test_engine import smollm2_chat_prompts

    name = "smollm2-135m-instruct"
    target = runtime.load_model(name, dtype=torch.bfloat16, weights="dense")
    rows = smollm2_chat_prompts(runtime.load_tokenizer(name))
    plain = specdec.generate(target, rows, max_new_tokens=64).sequences
    spec = specdec.generate(target, rows, draft="ngram", max_new_tokens=64).sequences
    assert all(torch.equal(a, b) for a, b in zip(spec, plain))
    for r, seq in zip(rows, plain):
        assert torch.equal(specdec.generate(target, [r], max_new_tokens=64).sequences[0], seq)
