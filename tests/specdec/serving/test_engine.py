"""The continuous-batching engine on tiny float32 models: requests joining and leaving a running
batch decode exactly what generate() decodes for each prompt alone."""

import threading

import pytest
import torch

import specdec
from runtime.errors import ContextLengthError
from specdec.drafter import Drafter, DraftTree
from specdec.drafters.medusa.heads import MedusaConfig, MedusaHeads
from specdec.serving.engine import Engine, SamplingParams
from tests.specdec.conftest import V


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:  # a repeated half, so n-gram lookup finds drafts
        half = torch.randint(0, V, ((n + 1) // 2,), generator=g)
        out.append(torch.cat([half, half])[:n])
    return out


def _alone(target, draft, prompt, max_new, eos=None):
    out = specdec.generate(target, [prompt], draft=draft, max_new_tokens=max_new, eos_token_id=eos)
    return out.sequences[0][prompt.numel():].tolist()


def _same_drafting(target, draft, req):
    """The request drafted and accepted what generate() alone does: the drafter's row state
    (its cache slot, pending states) was admitted and kept right, not just the target's."""
    out = specdec.generate(target, [req.prompt], draft=draft, max_new_tokens=req.params.max_new_tokens)
    return (req.target_forwards, req.drafted, req.accepted) == (
        out.stats.target_forwards, out.stats.drafted_tokens, out.stats.accepted_tokens)


def _draft(which, random_draft):
    return {"plain": None, "ngram": "ngram", "draft": random_draft, "hybrid": ["ngram", random_draft]}[which]


@pytest.mark.parametrize("which", ["plain", "ngram", "draft", "hybrid"])
def test_requests_joining_mid_flight_equal_generate_alone(target, random_draft, which):
    draft = _draft(which, random_draft)
    engine = Engine(target, draft, max_batch=3)
    prompts = _prompts([5, 9, 3, 12, 7, 4], seed=1)
    limits = [10, 16, 7, 20, 12, 9]
    reqs = [engine.submit(p, SamplingParams(max_new_tokens=m)) for p, m in zip(prompts[:2], limits[:2])]
    engine.step()
    reqs.append(engine.submit(prompts[2], SamplingParams(max_new_tokens=limits[2])))
    engine.step()
    engine.step()
    reqs += [engine.submit(p, SamplingParams(max_new_tokens=m)) for p, m in zip(prompts[3:], limits[3:])]
    assert engine.running == 3 and engine.waiting == 3
    engine.run_until_done()
    assert engine.running == 0 and engine.waiting == 0
    for req, p, m in zip(reqs, prompts, limits):
        assert req.finish_reason == "length" and len(req.tokens) == m
        assert req.tokens == _alone(target, draft, p, m)
        assert _same_drafting(target, draft, req)
    metrics = engine.metrics
    assert metrics["requests_finished"] == 6 and metrics["finished_length"] == 6
    assert metrics["generated_tokens"] == sum(limits)
    assert metrics["target_forwards"] == sum(r.target_forwards for r in reqs)
    if which != "plain":
        assert metrics["drafted"] == sum(r.drafted for r in reqs) > 0


@pytest.mark.parametrize("which", ["plain", "ngram", "draft"])
def test_rows_leave_on_their_own_eos_at_different_steps(target, random_draft, which):
    draft = _draft(which, random_draft)
    prompts = _prompts([6, 8, 5], seed=2)
    free = [_alone(target, draft, p, 24) for p in prompts]
    stops = [free[0][2], free[1][9], free[2][15]]  # each row's own stop token, reached at different steps
    engine = Engine(target, draft, max_batch=3)
    reqs = [engine.submit(p, SamplingParams(max_new_tokens=24, stop_token_ids=(s,))) for p, s in zip(prompts, stops)]
    done_at = {}
    step = 0
    while engine.running or engine.waiting:
        step += 1
        for req in engine.step():
            done_at[req.id] = step
    for req, f, s in zip(reqs, free, stops):
        assert req.finish_reason == "stop" and req.tokens == f[:f.index(s) + 1]
    assert len(set(done_at.values())) > 1


def test_engine_eos_ids_apply_to_every_request(target):
    prompts = _prompts([6, 8], seed=3)
    free = _alone(target, "ngram", prompts[0], 16)
    eos = free[4]
    engine = Engine(target, "ngram", max_batch=2, eos_token_id=eos)
    reqs = [engine.submit(p, SamplingParams(max_new_tokens=16)) for p in prompts]
    engine.run_until_done()
    for req, p in zip(reqs, prompts):
        assert req.tokens == _alone(target, "ngram", p, 16, eos=eos)
    assert reqs[0].finish_reason == "stop"


def test_listener_sees_every_token_once_then_the_finish(target):
    engine = Engine(target, "ngram", max_batch=2)
    seen, finals = [], []

    def listen(req, new):
        if new:
            assert not req.finished
            seen.extend(new)
        else:
            finals.append(req.finish_reason)

    req = engine.submit(_prompts([10], seed=4)[0], SamplingParams(max_new_tokens=14), on_tokens=listen)
    engine.run_until_done()
    assert seen == req.tokens and finals == ["length"]
    assert req.ttft_s > 0 and req.tpot_s > 0 and req.target_forwards >= 1


def test_cancel_a_running_and_a_waiting_request(target, random_draft):
    engine = Engine(target, random_draft, max_batch=2)
    prompts = _prompts([5, 7, 6], seed=5)
    calls = {i: 0 for i in range(3)}
    reqs = [engine.submit(p, SamplingParams(max_new_tokens=20), request_id=f"r{i}",
                          on_tokens=lambda r, new, i=i: calls.__setitem__(i, calls[i] + 1))
            for i, p in enumerate(prompts)]
    engine.step()
    engine.step()
    assert engine.running == 2 and engine.waiting == 1
    assert engine.cancel("r0") and engine.cancel("r2") and not engine.cancel("nope")
    before = dict(calls)
    finished = engine.step()
    assert {r.id for r in finished} >= {"r0", "r2"}
    assert reqs[0].finish_reason == reqs[2].finish_reason == "cancelled"
    assert reqs[2].tokens == []
    engine.run_until_done()
    assert calls[0] == before[0] and calls[2] == before[2] == 0  # no listener call after a cancel
    assert reqs[1].tokens == _alone(target, random_draft, prompts[1], 20)
    assert not engine.cancel("r1")  # finished
    assert engine.metrics["finished_cancelled"] == 2


def test_a_cancel_with_reason_stop_finishes_the_request_as_stopped(target):
    """cancel(id, "stop") (a caller's own stop condition, e.g. a stop string) retires the row as
    a stop token would: finish_reason "stop", the listener's final call, the stop counter; the row
    serves the next request."""
    engine = Engine(target, "ngram", max_batch=1)
    prompts = _prompts([6, 5], seed=13)
    finals = []
    req = engine.submit(prompts[0], SamplingParams(max_new_tokens=30), request_id="a",
                        on_tokens=lambda r, new: not new and finals.append(r.finish_reason))
    engine.step()
    assert engine.cancel("a", "stop")
    engine.step()
    assert req.finish_reason == "stop" and finals == ["stop"] and 1 <= len(req.tokens) < 30
    assert engine.metrics["finished_stop"] == 1 and engine.metrics["finished_cancelled"] == 0
    with pytest.raises(ValueError, match="'cancelled' or 'stop'"):
        engine.cancel("a", "length")
    nxt = engine.submit(prompts[1], SamplingParams(max_new_tokens=4))
    engine.run_until_done()
    assert nxt.tokens == _alone(target, "ngram", prompts[1], 4)


def test_a_cancel_that_races_the_finish_does_not_cancel_a_later_request_of_that_id(target):
    """A cancel arriving during the step that finishes the request (here from its own listener)
    is dropped with it: a later request that reuses the id runs to its end."""
    engine = Engine(target, "ngram", max_batch=2)
    prompt = _prompts([6], seed=12)[0]
    first = engine.submit(prompt, SamplingParams(max_new_tokens=1), request_id="same",
                          on_tokens=lambda r, new: new and engine.cancel(r.id))
    engine.run_until_done()
    assert first.finish_reason == "length"
    again = engine.submit(prompt, SamplingParams(max_new_tokens=3), request_id="same")
    engine.run_until_done()
    assert again.finish_reason == "length" and again.tokens == _alone(target, "ngram", prompt, 3)


def test_more_requests_than_rows_queue_and_reuse_the_slots(target):
    engine = Engine(target, "ngram", max_batch=2)
    prompts = _prompts([4, 9, 6, 3, 8], seed=6)
    reqs = [engine.submit(p, SamplingParams(max_new_tokens=6 + i)) for i, p in enumerate(prompts)]
    cache = engine.loop.cache
    buffers = cache.k.data_ptr()
    most = 0
    while engine.running or engine.waiting:
        engine.step()
        most = max(most, engine.running)
    assert most == 2 and cache.k.data_ptr() == buffers  # the cache was never re-created
    for i, (req, p) in enumerate(zip(reqs, prompts)):
        assert req.tokens == _alone(target, "ngram", p, 6 + i)
    assert engine.metrics["requests_total"] == engine.metrics["requests_finished"] == 5


@pytest.mark.parametrize("which", ["draft", "ngram"])
def test_sampled_requests_follow_their_own_seed(target, random_draft, which):
    """Also with n-gram drafts, whose length differs per row: a row draws random numbers for its
    own drafts only, not for the padding up to the batch's longest draft."""
    prompts = _prompts([6, 9, 5], seed=7)
    draft = _draft(which, random_draft)

    def run(companions, seed, max_batch=3):
        engine = Engine(target, draft, max_batch=max_batch)
        req = engine.submit(prompts[0], SamplingParams(max_new_tokens=16, temperature=0.9, seed=seed))
        others = [engine.submit(p, SamplingParams(max_new_tokens=12, temperature=t, seed=s))
                  for p, (t, s) in zip(prompts[1:], companions)]
        engine.run_until_done()
        return req.tokens, others

    alone, _ = run([], seed=11)
    mixed, others = run([(0.0, None), (1.3, 5)], seed=11)
    assert alone == mixed  # the same seed gives the same tokens whatever else runs
    assert others[0].tokens == _alone(target, draft, prompts[1], 12)  # a greedy row stays greedy
    assert run([], seed=12)[0] != alone


def test_submit_from_another_thread_while_stepping(target):
    engine = Engine(target, "ngram", max_batch=2)
    prompts = _prompts([5, 8, 6, 7], seed=8)
    reqs = [engine.submit(prompts[0], SamplingParams(max_new_tokens=30))]

    def feed():
        for p in prompts[1:]:
            reqs.append(engine.submit(p, SamplingParams(max_new_tokens=10)))

    worker = threading.Thread(target=feed)
    worker.start()
    while worker.is_alive() or engine.running or engine.waiting:
        engine.step()
    worker.join()
    engine.run_until_done()
    assert len(reqs) == 4
    for req in reqs:
        assert req.tokens == _alone(target, "ngram", req.prompt, req.params.max_new_tokens)


def test_bad_requests_are_refused_at_submit(target):
    engine = Engine(target, max_batch=2, max_len=32)
    with pytest.raises(ContextLengthError, match="max_len"):
        engine.submit(torch.arange(20), SamplingParams(max_new_tokens=13))
    with pytest.raises(ValueError, match="vocabulary"):
        engine.submit(torch.tensor([1, V]), SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match="non-empty"):
        engine.submit(torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match="stop token"):
        engine.submit(torch.tensor([1, 2]), SamplingParams(stop_token_ids=(V + 3,)))
    with pytest.raises(TypeError, match="SamplingParams"):
        engine.submit(torch.tensor([1, 2]), {"max_new_tokens": 4})
    engine.submit(torch.tensor([1, 2]), SamplingParams(max_new_tokens=4), request_id="a")
    with pytest.raises(ValueError, match="already"):
        engine.submit(torch.tensor([3, 4]), SamplingParams(max_new_tokens=4), request_id="a")
    assert engine.waiting == 1  # nothing refused was queued
    for bad, match in ((dict(max_new_tokens=-1), "max_new_tokens"), (dict(temperature=-0.5), "temperature"),
                       (dict(top_p=0.0), "top_p"), (dict(seed=-3), "seed"), (dict(stop_token_ids=(1.5,)), "stop")):
        with pytest.raises(ValueError, match=match):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match="max_batch"):
        Engine(target, max_batch=0)
    with pytest.raises(ValueError, match="max_len"):
        Engine(target, max_len=10 ** 6)


@pytest.mark.parametrize("target_arg,error,first", [
    (None, TypeError, "target must be a runtime model"),
    ("/path/ckpt", TypeError, "target must be a loaded model, got the path or name '/path/ckpt'; load it first: "
                              "runtime.load_model('/path/ckpt')"),
])
def test_an_engine_needs_a_loaded_model(target_arg, error, first):
    with pytest.raises(error) as err:
        Engine(target_arg)
    assert str(err.value).startswith(first)


def test_an_engine_refuses_an_eos_id_outside_the_vocabulary(target):
    with pytest.raises(ValueError, match=rf"^eos_token_id holds token id {10 ** 6}, outside the model's vocabulary"):
        Engine(target, max_batch=1, max_len=32, eos_token_id=[1, 10 ** 6])


@pytest.mark.parametrize("prompt,kw,error,first", [
    (None, {}, TypeError, "prompt_ids must be a 1-D LongTensor or a list of token ids (tokenize a text first), "
                          "got None"),
    ("hello", {}, TypeError, "prompt_ids must be a 1-D LongTensor or a list of token ids (tokenize a text first), "
                             "got 'hello'"),
    ([1, "a"], {}, TypeError, "prompt_ids must be a 1-D LongTensor or a list of token ids, got [1, 'a']"),
    (torch.tensor([1, 2], device="meta"), {}, ValueError, "prompt_ids is on the meta device"),
    ([1.5, 2.0], {}, ValueError, "prompt_ids must hold integer token ids"),
    ([1, 2], dict(on_tokens=5), TypeError, "on_tokens must be a callable"),
    ([1, 2], dict(request_id=5), TypeError, "request_id must be a str or None"),
    ([1, 2], dict(request_id=""), ValueError, "request_id is empty"),
])
def test_submit_names_the_bad_argument(target, prompt, kw, error, first):
    engine = Engine(target, max_batch=1, max_len=32)
    with pytest.raises(error) as err:
        engine.submit(prompt, SamplingParams(max_new_tokens=2), **kw)
    assert str(err.value).startswith(first)
    assert engine.waiting == 0


def test_zero_new_tokens_finishes_at_once(target):
    engine = Engine(target, max_batch=1)
    req = engine.submit(torch.tensor([1, 2, 3]), SamplingParams(max_new_tokens=0))
    engine.run_until_done()
    assert req.finish_reason == "length" and req.tokens == []


def test_medusa_rows_join_mid_flight(target):
    heads = MedusaHeads(MedusaConfig(target.config.hidden_size, V, num_heads=2, tree=((0,), (1,), (0, 0), (1, 0))),
                        target.lm_head)
    g = torch.Generator().manual_seed(0)
    for blk in heads.blocks:
        blk[0].linear.weight.data = torch.randn(64, 64, generator=g) * 0.3
    engine = Engine(target, heads, max_batch=2)
    prompts = _prompts([5, 9, 7], seed=9)
    reqs = [engine.submit(prompts[0], SamplingParams(max_new_tokens=15))]
    engine.step()
    reqs += [engine.submit(p, SamplingParams(max_new_tokens=11)) for p in prompts[1:]]
    engine.run_until_done()
    for req in reqs:
        assert req.tokens == _alone(target, heads, req.prompt, req.params.max_new_tokens)
        assert _same_drafting(target, heads, req)


def test_a_drafter_without_admit_is_refused_by_name(target):
    class Fixed(Drafter):
        name = "fixed"

        def propose(self, seqs, k, rows):
            return DraftTree.empty(len(seqs))

    with pytest.raises(NotImplementedError, match="'fixed'"):
        Engine(target, Fixed())


def test_eagle_rows_join_mid_flight():
    from runtime.tiny import tiny_model
    from specdec.drafters.eagle.head import Eagle3Config, Eagle3Head

    deep = tiny_model("llama", seed=5, vocab_size=V, num_hidden_layers=6)
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config.from_target(deep, draft_vocab_size=32))
    head.set_draft_vocab(torch.arange(32) * 2)
    engine = Engine(deep, head, max_batch=2)
    prompts = _prompts([6, 10, 4], seed=10)
    reqs = [engine.submit(prompts[0], SamplingParams(max_new_tokens=14))]
    engine.step()
    engine.step()
    reqs += [engine.submit(p, SamplingParams(max_new_tokens=9)) for p in prompts[1:]]
    engine.run_until_done()
    for req in reqs:
        assert req.tokens == _alone(deep, head, req.prompt, req.params.max_new_tokens)
        assert _same_drafting(deep, head, req)
    assert engine.metrics["drafted"] > 0
    assert engine.prefixes is None  # EAGLE-3 reads every prompt position's states: no prefix cache


def test_a_compiled_target_keeps_the_batch_and_its_programs(target):
    """On a compile_decode target every step runs the compiled program at max_batch rows (free rows
    ride along), admissions prefill eagerly (no one-row program), and the output equals generate()."""
    from runtime import compile_decode
    from runtime.tiny import tiny_model

    compiled = compile_decode(tiny_model("llama", seed=0, vocab_size=V))  # the fixture's weights
    shapes = []
    step = compiled.compiled_step
    compiled.compiled_step = lambda *a: shapes.append(tuple(a[0].shape)) or step(*a)
    engine = Engine(compiled, "ngram", max_batch=2, max_len=64)
    prompts = _prompts([5, 9, 4], seed=11)
    reqs = [engine.submit(prompts[0], SamplingParams(max_new_tokens=12))]
    engine.step()
    reqs += [engine.submit(p, SamplingParams(max_new_tokens=8)) for p in prompts[1:]]
    engine.run_until_done()
    for req in reqs:
        assert req.tokens == _alone(target, "ngram", req.prompt, req.params.max_new_tokens)
    assert shapes and {b for b, _ in shapes} == {2}


def test_a_cache_row_view_writes_into_the_shared_cache(target):
    from specdec.rows import prefill, runs

    assert runs([3, 0, 1, 5, 4]) == [[0, 1], [3, 4, 5]]
    cache = target.new_cache(3, 32)
    cache.lengths[:] = torch.tensor([5, 7, 2])
    pool_k = cache.k.clone()
    slot = cache.rows(1, 2)  # rows 1 and 2
    slot.lengths.zero_()
    prompts = _prompts([6, 4], seed=12)
    logits = prefill(target, prompts, slot).logits  # (2, V)
    assert cache.lengths.tolist() == [5, 6, 4]  # the view's lengths are the pool's
    assert torch.equal(cache.k[:, 0], pool_k[:, 0])  # row 0 untouched
    alone = target.new_cache(1, 32)
    ref = prefill(target, prompts[:1], alone).logits
    assert torch.allclose(logits[0], ref[0], atol=1e-5)
    assert torch.allclose(cache.k[:, 1, :, :6], alone.k[:, 0, :, :6], atol=1e-6)
    with pytest.raises(ValueError, match="outside"):
        cache.rows(2, 2)


SMOLLM2_QUESTIONS = [
    "Write a Python function that checks whether a number is prime.",
    "Explain the difference between a list and a tuple in Python.",
    "Translate to French: The weather is nice today and we are going to the beach.",
    "What is 17 times 23? Show your steps.",
    "Summarize: The mitochondria is the powerhouse of the cell; it produces ATP through respiration.",
    "Write a haiku about autumn leaves.",
    "List three uses of binary search trees.",
    "How do I reverse a string in JavaScript?",
]


def smollm2_chat_prompts(tok) -> list[torch.Tensor]:
    """SMOLLM2_QUESTIONS through the chat template, as token ids."""
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
             for q in SMOLLM2_QUESTIONS]
    return [torch.tensor(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]


@pytest.mark.real_model
def test_bf16_requests_served_together_each_equal_the_request_alone():
    """Real smollm2 in bf16 (row-invariant kernels): 8 greedy requests of mixed lengths through 4
    rows each decode what the same request decodes alone (with batch-dependent kernels about a
    third differ)."""
    import runtime

    name = "smollm2-135m-instruct"
    target = runtime.load_model(name, dtype=torch.bfloat16, weights="dense")
    assert target.row_invariant
    prompts = smollm2_chat_prompts(runtime.load_tokenizer(name))
    lengths = [16 + 8 * (i % 4) for i in range(len(prompts))]  # 16..40 new tokens
    engine = Engine(target, "ngram", max_batch=4, max_len=256)
    requests = [engine.submit(p, SamplingParams(max_new_tokens=n)) for p, n in zip(prompts, lengths)]
    engine.run_until_done()
    for req, p, n in zip(requests, prompts, lengths):
        assert req.tokens == _alone(target, "ngram", p, n)


def test_the_suffix_cache_is_shared_across_requests_and_metrics_name_each_drafter(target, monkeypatch):
    """Served twice, the same prompts draft from the first pass's answers: tau rises, outputs equal
    plain decoding, and the metrics count the steps of each member of the composite."""
    from specdec.drafters import CompositeDrafter
    from specdec.drafters.suffix import SuffixCache, SuffixConfig, SuffixDrafter
    from specdec.loader import make_drafter

    # every block costs the same: proposals are whole and chosen by expected tokens, not by timings of a busy machine
    monkeypatch.setattr(CompositeDrafter, "_verify_s", lambda self, rows: 1.0)
    drafter = CompositeDrafter([SuffixDrafter(SuffixConfig(cut=False), cache=SuffixCache(4096)),
                                make_drafter("ngram", target)])
    engine = Engine(target, drafter, max_batch=3)
    prompts = _prompts([5, 9, 3, 12], seed=3)
    tau = []
    for _ in range(2):
        before = engine.metrics
        reqs = [engine.submit(p, SamplingParams(max_new_tokens=16)) for p in prompts]
        engine.run_until_done()
        after = engine.metrics
        tau.append((after["generated_tokens"] - before["generated_tokens"])
                   / (after["target_forwards"] - before["target_forwards"]))
        for req, p in zip(reqs, prompts):
            assert req.tokens == _alone(target, None, p, 16)
    assert tau[1] > 1.3 * tau[0]
    by = engine.metrics["by_drafter"]
    assert by["suffix"]["steps"] > 0 and by["suffix"]["accepted"] > 0
    assert sum(d["steps"] for d in by.values()) <= engine.metrics["target_forwards"]
