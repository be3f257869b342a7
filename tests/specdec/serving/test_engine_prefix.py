"""The engine's prefix cache: a request prefills only what its prompt adds to the tokens cached
from earlier prompts and answers, and decodes exactly what generate() decodes for it alone."""

import pytest
import torch

import specdec
from runtime.tiny import tiny_model
from specdec.rows import prefill, prefill_after
from specdec.serving.engine import Engine, SamplingParams
from tests.specdec.conftest import V


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed))


def _alone(target, draft, prompt, max_new):
    out = specdec.generate(target, [prompt], draft=draft, max_new_tokens=max_new)
    return out.sequences[0][prompt.numel():].tolist()


def _draft(which, random_draft):
    return {"plain": None, "ngram": "ngram", "draft": random_draft, "hybrid": ["ngram", random_draft]}[which]


def _engine(target, draft, paged: bool, **kw) -> Engine:
    """An engine with per-row slots, or with a paged cache of as many positions (its prefix cache
    then holds blocks of that pool by reference)."""
    tokens = kw["max_batch"] * kw["max_len"] if paged else 0
    return Engine(target, draft, kv_cache_tokens=tokens, **kw)


def _same_keys_as_a_whole_prefill(engine, req) -> bool:
    """After its admission, the request's row holds the keys and values a prefill of its whole
    prompt writes (float32: to rounding)."""
    row, n = engine.slots.index(req), req.prompt.numel()
    fresh = engine.target.new_cache(1, n + 1)
    with torch.inference_mode():
        prefill(engine.target, [req.prompt], fresh)
    k, v = engine.loop.cache.read_row(row, 0, n)
    return (torch.allclose(k, fresh.k[:, 0, :, :n], atol=1e-5)
            and torch.allclose(v, fresh.v[:, 0, :, :n], atol=1e-5))


def _chat(engine, turns: list[torch.Tensor], max_new: int) -> list[tuple[torch.Tensor, list[int]]]:
    """A conversation: each turn resends every earlier prompt and answer, then its own message."""
    history, out = turns[0][:0], []
    for message in turns:
        prompt = torch.cat([history, message])
        req = engine.submit(prompt, SamplingParams(max_new_tokens=max_new))
        engine.step()
        assert _same_keys_as_a_whole_prefill(engine, req)
        engine.run_until_done()
        out.append((prompt, req.tokens))
        history = torch.cat([prompt, torch.tensor(req.tokens)])
    return out


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("which", ["plain", "ngram", "draft", "hybrid"])
def test_later_turns_prefill_only_what_they_add_and_equal_generate_alone(target, random_draft, which, paged):
    draft = _draft(which, random_draft)
    engine = _engine(target, draft, paged, max_batch=2, max_len=256)
    turns = [_ids(n, seed) for seed, n in enumerate([21, 9, 14, 6])]
    answers = _chat(engine, turns, max_new=12)
    for prompt, tokens in answers:
        assert tokens == _alone(target, draft, prompt, 12)
    m = engine.metrics
    prompt_tokens = sum(p.numel() for p, _ in answers)
    assert m["prefix_cache_hits"] == 3  # every turn after the first
    # reuse is token by token: a turn prefills its message and the last answer token (never fed)
    assert m["prefill_tokens"] == turns[0].numel() + sum(t.numel() + 1 for t in turns[1:])
    assert m["prefill_tokens"] == prompt_tokens - m["prefix_cache_hit_tokens"]


def test_prefix_cache_off_prefills_every_prompt_whole(target):
    engine = Engine(target, None, max_batch=2, max_len=256, prefix_cache_tokens=0)
    answers = _chat(engine, [_ids(20, 1), _ids(8, 2)], max_new=10)
    m = engine.metrics
    assert engine.prefixes is None and m["prefix_cache_hits"] == 0
    assert m["prefill_tokens"] == sum(p.numel() for p, _ in answers)


@pytest.mark.parametrize("paged", [False, True])
def test_requests_sharing_a_system_prompt_prefill_it_once(target, random_draft, paged):
    """8 requests arriving at once with a common 40-token prefix, 4 rows: the first prefills it,
    the others copy its blocks (a paged cache: take its full blocks by reference), the partial one
    after the last full block too (those admitted beside it wait for its prefill)."""
    system = _ids(40, 7)
    # each message starts with a token of its own: the prompts share exactly the 40 tokens
    prompts = [torch.cat([system, torch.tensor([i]), _ids(3 + i, 20 + i)]) for i in range(8)]
    engine = _engine(target, random_draft, paged, max_batch=4, max_len=128, prefix_cache_tokens=512)
    reqs = [engine.submit(p, SamplingParams(max_new_tokens=8)) for p in prompts]
    engine.step()
    engine.step()  # the rows admitted after the first one's prefill hold its 2 full blocks once
    if paged:
        tables = engine.loop.cache.block_table[:, :2]
        assert bool((tables == tables[0]).all()) and engine.loop.cache.pool.refs[int(tables[0, 0])] == 5
    engine.run_until_done()
    for req, p in zip(reqs, prompts):
        assert req.tokens == _alone(target, random_draft, p, 8)
    m = engine.metrics
    assert 40 % m["prefix_cache_block"]  # the shared part ends inside a block
    assert m["prefix_cache_hits"] == 7 and m["prefix_cache_hit_tokens"] == 7 * 40
    assert m["prefill_tokens"] == sum(p.numel() for p in prompts) - 7 * 40


@pytest.mark.parametrize("paged", [False, True])
def test_a_small_cache_evicts_under_pressure_and_answers_stay_exact(target, paged):
    engine = _engine(target, None, paged, max_batch=2, max_len=256, prefix_cache_tokens=48)
    for seed in range(3):
        for prompt, tokens in _chat(engine, [_ids(30, 100 + seed), _ids(5, 200 + seed)], max_new=10):
            assert tokens == _alone(target, None, prompt, 10)
    m = engine.metrics
    assert m["prefix_cache_evictions"] > 0 and m["prefix_cache_num_blocks"] == 3
    assert m["prefix_cache_blocks_cached"] <= 3


@pytest.mark.parametrize("paged", [False, True])
def test_a_failed_admission_never_poisons_a_cached_block(target, monkeypatch, paged):
    """A request whose prefill fails after writing NaN keys into its row ends with "error"; the
    cached blocks of its prefix stay as they were, and the next request sharing them is exact."""
    import specdec.decode

    system = _ids(40, 3)
    engine = _engine(target, None, paged, max_batch=2, max_len=128)
    first = engine.submit(torch.cat([system, _ids(4, 4)]), SamplingParams(max_new_tokens=6))
    engine.run_until_done()
    cached = engine.metrics["prefix_cache_blocks_cached"]

    def failing(model, tail, cache, **kw):
        if paged:  # the row's slots from its length on, what a prefill writes (its shared blocks lie below)
            start = int(cache.lengths[0])
            nan = torch.full((cache.k.shape[0], cache.k.shape[2], tail.numel(), cache.k.shape[4]), float("nan"))
            cache.write_row(0, start, nan, nan)
        else:
            cache.k.fill_(float("nan"))  # the row's keys, the copied prefix included
        raise RuntimeError("prefill failed")

    monkeypatch.setattr(specdec.decode, "prefill_after", failing)
    bad = engine.submit(torch.cat([system, _ids(5, 5)]), SamplingParams(max_new_tokens=6))
    engine.run_until_done()
    assert bad.finish_reason == "error" and "prefill failed" in bad.error.message
    assert engine.metrics["prefix_cache_blocks_cached"] == cached
    monkeypatch.undo()
    prompt = torch.cat([system, _ids(6, 6)])
    good = engine.submit(prompt, SamplingParams(max_new_tokens=6))
    engine.step()
    assert _same_keys_as_a_whole_prefill(engine, good)
    engine.run_until_done()
    assert first.finish_reason == good.finish_reason == "length"
    assert good.tokens == _alone(target, None, prompt, 6)
    assert engine.metrics["prefix_cache_hits"] == 2


@pytest.mark.parametrize("tokens", [-1, 8, 1.5, True])
def test_a_bad_prefix_cache_size_is_refused(target, tokens):
    with pytest.raises(ValueError, match="prefix_cache_tokens"):
        Engine(target, None, max_batch=1, max_len=64, prefix_cache_tokens=tokens)


def test_bf16_a_prompt_prefilled_after_a_cached_prefix_has_the_bits_of_a_whole_prefill():
    """Row-invariant bf16 forwards: keys and logits do not depend on where the prompt was split."""
    model = tiny_model("llama", seed=0, vocab_size=V, dtype=torch.bfloat16)
    assert model.row_invariant  # bf16 on the CPU with the C++ kernels that `make test` builds
    prompt = _ids(37, 9)
    cache = model.new_cache(2, 64)
    with torch.inference_mode():
        whole = prefill(model, [prompt], cache.rows(0))
        row = cache.rows(1)
        prefill(model, [prompt[:16]], row)
        split = prefill_after(model, prompt[16:], row)
    assert torch.equal(whole.logits, split.logits)
    assert torch.equal(cache.k[:, 0, :, :37], cache.k[:, 1, :, :37])
    assert torch.equal(cache.v[:, 0, :, :37], cache.v[:, 1, :, :37])
