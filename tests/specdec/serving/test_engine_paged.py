"""The engine over a paged KV cache: requests hold blocks of one pool while they run, are admitted
when the pool has room for them, are preempted (and resume exactly) when it runs out, decode exactly
what generate() decodes for them alone, and give every block back when they end, faults included."""

import pytest
import torch

from runtime.errors import ContextLengthError
from specdec.serving.engine import Engine, SamplingParams
from tests.specdec.serving.test_engine import _alone, _draft, _prompts
from tests.specdec.serving.test_engine_faults import _AdmitFault, _poisoned, _ReleaseFault


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
        in_use.append(engine.metrics["kv_blocks_used"])
    for req, p, m in zip(reqs, prompts, limits):
        assert req.finish_reason == "length" and req.tokens == _alone(target, draft, p, m)
    m = engine.metrics
    assert (m["kv_blocks_total"], m["kv_block_size"], m["kv_tokens_capacity"]) == (10, 16, 160)
    assert max(in_use) <= 10
    # what stays in use is the prefix cache's, held by no row: free as soon as a request needs it
    assert m["kv_blocks_used"] == m["prefix_cache_blocks_cached"] == engine.prefixes.evictable > 0


def test_short_requests_outnumber_what_per_row_slots_would_hold(target):
    """The memory of 2 rows of 64 slots (128 positions) as a paged pool serves 6 short requests at
    once: each may come to hold prompt + 4 new tokens + one step's 6 slots, one block of 16."""
    engine = Engine(target, "ngram", max_batch=6, max_len=64, kv_cache_tokens=128, prefix_cache_tokens=0)
    prompts = _prompts([4, 5, 6, 4, 5, 6], seed=3)
    reqs = [engine.submit(p, SamplingParams(max_new_tokens=4)) for p in prompts]
    engine.step()
    assert engine.running == 6 and engine.metrics["kv_blocks_used"] == 6
    engine.run_until_done()
    for req, p in zip(reqs, prompts):
        assert req.tokens == _alone(target, "ngram", p, 4)


@pytest.fixture(scope="module")
def bf16_target():
    """The fixture's target in bf16: row-invariant forwards, so a preempted request admitted again with
    its prompt and tokens so far decodes on bit for bit as it would have."""
    from runtime.tiny import tiny_model
    from tests.specdec.conftest import V

    model = tiny_model("llama", seed=0, vocab_size=V).to(torch.bfloat16)
    assert model.row_invariant
    return model


@pytest.mark.parametrize("which", ["plain", "ngram"])
def test_a_full_pool_preempts_the_latest_request_which_resumes_exactly(bf16_target, which):
    """Three requests fit the 5-block pool as they start (a block each), not as they grow: the latest admitted is
    preempted when a step finds no block, waits at the head of the queue, is admitted again with its
    prompt and tokens so far, and every answer equals generate() alone, each token delivered once."""
    draft = None if which == "plain" else "ngram"
    engine = Engine(bf16_target, draft, max_batch=3, max_len=64, kv_cache_tokens=80, prefix_cache_tokens=0)
    prompts = _prompts([10, 10, 10], seed=4)
    limits = (40, 12, 40)
    seen = {i: [] for i in range(3)}
    reqs = [engine.submit(p, SamplingParams(max_new_tokens=n), on_tokens=lambda r, new, i=i: seen[i].extend(new))
            for i, (p, n) in enumerate(zip(prompts, limits))]
    engine.step()
    assert engine.running == 3
    engine.run_until_done()
    assert engine.metrics["preemptions"] >= 1 and reqs[2].preemptions >= 1 and reqs[0].preemptions == 0
    for i, (req, p, n) in enumerate(zip(reqs, prompts, limits)):
        assert req.finish_reason == "length" and req.tokens == seen[i] == _alone(bf16_target, draft, p, n)
    assert reqs[2].target_forwards >= len(reqs[2].tokens) // (1 + 5 * (which == "ngram"))  # counted across its runs
    assert engine.metrics["kv_blocks_used"] == 0


def test_a_preempted_request_reuses_its_cached_blocks(bf16_target):
    """With the prefix cache on, a preempted request's prompt and answer go to the cache: admitted again, it
    looks them up (under the pressure that preempted it most are evicted) and decodes on exactly."""
    engine = Engine(bf16_target, None, max_batch=3, max_len=64, kv_cache_tokens=80)
    prompts = _prompts([10, 10, 10], seed=4)
    reqs = [engine.submit(p, SamplingParams(max_new_tokens=n)) for p, n in zip(prompts, (40, 12, 40))]
    engine.run_until_done()
    m = engine.metrics
    assert m["preemptions"] >= 1 and m["prefix_cache_hits"] >= 1  # the pressure evicts most of what it put
    for req, p, n in zip(reqs, prompts, (40, 12, 40)):
        assert req.tokens == _alone(bf16_target, None, p, n)


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
    assert engine.metrics["kv_blocks_used"] == engine.prefixes.evictable  # the cached prefixes only
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


def test_the_serve_warm_up_builds_the_programs_of_the_engines_own_paged_cache():
    """`serve --compile` with a drafter whose trees change size runs every block step on the engine's own
    cache first: its programs are keyed by the pool's and the table's shapes, so serving compiles nothing."""
    from torch._dynamo.utils import counters

    from runtime import compile_decode
    from runtime.tiny import tiny_model
    from specdec.tuning.warmup import compile_block_steps
    from tests.specdec.conftest import V

    model = compile_decode(tiny_model("llama", seed=0, vocab_size=V), cpp_wrapper=False)
    engine = Engine(model, "ngram", max_batch=2, max_len=64)
    compile_block_steps(model, cache=engine.loop.cache)
    assert int(engine.loop.cache.lengths.sum()) == 0 and engine.loop.cache.blocks_in_use == 0
    compiled = counters["stats"]["unique_graphs"]
    prompts = _prompts([9, 12, 7], seed=6)
    reqs = [engine.submit(p, SamplingParams(max_new_tokens=12)) for p in prompts]
    engine.run_until_done()
    assert counters["stats"]["unique_graphs"] == compiled
    for req, p in zip(reqs, prompts):
        assert req.tokens == _alone(model, "ngram", p, 12)


def test_a_preempted_request_whose_release_fails_ends_with_the_error(bf16_target):
    """The drafter cannot release the preempted row: that request ends with "error" at once (its
    listener told), instead of waiting in no queue; the others decode as alone."""
    engine = Engine(bf16_target, _ReleaseFault(), max_batch=3, max_len=64, kv_cache_tokens=80, prefix_cache_tokens=0)
    prompts = _prompts([10, 10, 10], seed=4)
    ends = []
    reqs = [engine.submit(p, SamplingParams(max_new_tokens=n), on_tokens=lambda r, new: new or ends.append(r.id))
            for p, n in zip(prompts, (40, 12, 40))]
    engine.run_until_done()
    assert reqs[2].finish_reason == "error" and reqs[2].error.stage == "release" and reqs[2].id in ends
    for req, p, n in zip(reqs[:2], prompts, (40, 12)):
        assert req.finish_reason == "length" and req.tokens == _alone(bf16_target, "ngram", p, n)
    assert engine.running == engine.waiting == 0 and engine.loop.cache.blocks_in_use == 0
