"""The engine over a paged KV cache: requests hold blocks of one pool while they run, are admitted
when the pool can hold them, decode exactly what generate() decodes for them alone, and give every
block back when they end, faults included."""

import pytest

from runtime.errors import ContextLengthError
from specdec.serving.engine import Engine, SamplingParams
from tests.specdec.serving.test_engine import _alone, _draft, _prompts
from tests.specdec.serving.test_engine_faults import _AdmitFault, _poisoned


@pytest.mark.parametrize("which", ["plain", "ngram", "draft"])
def test_paged_requests_equal_generate_alone_and_give_their_blocks_back(target, random_draft, which):
    draft = _draft(which, random_draft)
    engine = Engine(target, draft, max_batch=4, max_len=64, kv_cache_tokens=160)
    prompts = _prompts([5, 9, 3, 12, 7, 20, 11], seed=2)
    limits = [10, 16, 7, 20, 12, 30, 5]
    reqs = [engine.submit(p, SamplingParams(max_new_tokens=m)) for p, m in zip(prompts, limits)]
    in_use = []
    while engine.waiting or engine.running:
        engine.step()
        in_use.append(engine.metrics["kv_blocks_in_use"])
    for req, p, m in zip(reqs, prompts, limits):
        assert req.finish_reason == "length" and req.tokens == _alone(target, draft, p, m)
    m = engine.metrics
    assert (m["kv_blocks_total"], m["kv_block_size"], m["kv_tokens_capacity"]) == (10, 16, 160)
    assert max(in_use) <= 10
    # what stays in use is the prefix cache's, held by no row: free as soon as a request needs it
    assert m["kv_blocks_in_use"] == m["prefix_cache_blocks_cached"] == engine.prefixes.evictable > 0


def test_short_requests_outnumber_what_per_row_slots_would_hold(target):
    """The memory of 2 rows of 64 slots (128 positions) as a paged pool serves 6 short requests at
    once: each may come to hold prompt + 4 new tokens + one step's 6 slots, one block of 16."""
    engine = Engine(target, "ngram", max_batch=6, max_len=64, kv_cache_tokens=128, prefix_cache_tokens=0)
    prompts = _prompts([4, 5, 6, 4, 5, 6], seed=3)
    reqs = [engine.submit(p, SamplingParams(max_new_tokens=4)) for p in prompts]
    engine.step()
    assert engine.running == 6 and engine.metrics["kv_blocks_in_use"] == 6
    engine.run_until_done()
    for req, p in zip(reqs, prompts):
        assert req.tokens == _alone(target, "ngram", p, 4)


def test_a_request_waits_until_the_pool_can_hold_it(target):
    """Two requests hold 3 + 2 of the pool's 5 blocks: the third waits for blocks, not for a row."""
    engine = Engine(target, None, max_batch=3, max_len=64, kv_cache_tokens=80, prefix_cache_tokens=0)
    prompts = _prompts([20, 20, 6], seed=4)
    reqs = [engine.submit(p, SamplingParams(max_new_tokens=n)) for p, n in zip(prompts, (20, 8, 4))]
    engine.step()
    assert (engine.running, engine.waiting) == (2, 1)
    while reqs[1].finish_reason is None:
        engine.step()
    engine.step()
    assert reqs[2].tokens  # admitted once the second request's blocks came back
    engine.run_until_done()
    for req, p, n in zip(reqs, prompts, (20, 8, 4)):
        assert req.tokens == _alone(target, None, p, n)


def test_a_request_larger_than_the_pool_is_refused_at_submit(target):
    engine = Engine(target, None, max_batch=2, max_len=200, kv_cache_tokens=64)
    with pytest.raises(ContextLengthError, match="kv_cache_tokens"):
        engine.submit(_prompts([40])[0], SamplingParams(max_new_tokens=40))
    with pytest.raises(ValueError, match="kv_cache_tokens"):
        Engine(target, None, max_batch=2, kv_cache_tokens=-1)
    default = Engine(target, None, max_batch=2, max_len=100)  # paged, as much as per-row slots and their prefix pool
    assert default.metrics["kv_tokens_capacity"] == 400 and default.prefixes.kv is default.loop.cache
    slots = Engine(target, None, max_batch=2, max_len=100, kv_cache_tokens=0)
    assert slots.loop.cache.block_table is None and slots.prefixes.num_blocks * 16 == 192


def test_faulty_requests_free_their_blocks_and_zero_them(target):
    """An admission fault and NaN logits end their requests; their blocks come back zeroed (no NaN
    left in the pool) and the others decode as alone."""
    prompts = _prompts(4 * [8], seed=5)
    engine = Engine(target, _AdmitFault(prompts[1]), max_batch=3, max_len=48, kv_cache_tokens=144)
    reqs = [engine.submit(p, SamplingParams(max_new_tokens=10)) for p in prompts]
    engine.run_until_done()
    assert reqs[1].finish_reason == "error" and reqs[1].error.stage == "admission"
    assert engine.metrics["kv_blocks_in_use"] == engine.prefixes.evictable  # the cached prefixes only
    for i in (0, 2, 3):
        assert reqs[i].tokens == _alone(target, "ngram", prompts[i], 10)

    clean = _alone(target, "ngram", prompts[0], 10)
    model = _poisoned(target, clean[3])
    engine = Engine(model, "ngram", max_batch=2, max_len=48, kv_cache_tokens=96)
    bad = engine.submit(prompts[0], SamplingParams(max_new_tokens=10))
    engine.run_until_done()
    assert bad.finish_reason == "error" and bad.error.stage == "sampling"
    cache = engine.loop.cache
    assert cache.blocks_in_use == engine.prefixes.evictable  # the prompt's cached blocks only
    assert not bool(cache.k.isnan().any()) and not bool(cache.v.isnan().any())
