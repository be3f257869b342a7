"""Faults stay with their request: a listener, sampling, admission or release that raises for one
request ends it with finish_reason "error" and frees its row, while the other requests decode
exactly what they decode alone; a failed shared step ends the requests in flight and the engine
serves on. Faults are injected at seeded random steps."""

import copy
import logging
import random

import pytest
import torch

import specdec
from specdec.drafters.ngram import NgramDrafter
from specdec.serving.engine import Engine, RequestError, SamplingParams
from tests.specdec.conftest import V


def _prompts(count: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):  # a repeated half, so n-gram lookup finds drafts
        half = torch.randint(2, V, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g)
        out.append(torch.cat([half, half]))
    return out


def _alone(target, draft, prompt, params: SamplingParams) -> list[int]:
    """The request's tokens in an engine of its own."""
    engine = Engine(target, draft, max_batch=1)
    req = engine.submit(prompt, params)
    engine.run_until_done()
    return req.tokens


def _raising_at(call: int, finals: list):
    """A listener that raises on its `call`-th call with tokens, and records its final call."""
    calls = [0]

    def listen(req, new):
        if not new:
            finals.append((req.finish_reason, req.error))
            return
        calls[0] += 1
        if calls[0] == call:
            raise RuntimeError(f"listener fault at call {call}")

    return listen


@pytest.mark.parametrize("which", ["plain", "ngram", "draft"])
def test_a_listener_that_raises_at_a_random_step_ends_its_request_only(target, random_draft, which):
    draft = {"plain": None, "ngram": "ngram", "draft": random_draft}[which]
    rng = random.Random(51)
    prompts = _prompts(6, seed=21)
    params = [SamplingParams(max_new_tokens=12 + 2 * i) for i in range(6)]
    params[2] = SamplingParams(max_new_tokens=14, temperature=0.8, seed=5)  # sampled: its own generator
    victim, call = rng.randrange(6), rng.randint(1, 4)
    finals: list = []
    engine = Engine(target, draft, max_batch=3)
    reqs = [engine.submit(p, s, on_tokens=_raising_at(call, finals) if i == victim else None)
            for i, (p, s) in enumerate(zip(prompts, params))]
    engine.run_until_done()
    assert engine.running == 0 and engine.waiting == 0
    bad = reqs[victim]
    assert bad.finish_reason == "error" and bad.error == RequestError("listener", "RuntimeError",
                                                                      f"listener fault at call {call}")
    assert finals == [("error", bad.error)]  # the listener still hears how its request ended
    assert len(bad.tokens) < params[victim].max_new_tokens
    for i, (req, p, s) in enumerate(zip(reqs, prompts, params)):
        if i != victim:
            assert req.finish_reason == "length" and req.tokens == _alone(target, draft, p, s), i
    assert engine.metrics["finished_error"] == 1 and engine.metrics["finished_length"] == 5
    later = engine.submit(prompts[victim], params[victim])  # the engine serves on, the failed row too
    engine.run_until_done()
    assert later.tokens == _alone(target, draft, prompts[victim], params[victim])


def test_a_listener_that_raises_on_its_final_call_is_logged(target, caplog):
    engine = Engine(target, "ngram", max_batch=2)
    prompts = _prompts(2, seed=22)

    def listen(req, new):
        if not new:
            raise ValueError("final call fault")

    caplog.set_level(logging.WARNING, logger="specdec.serving.engine")
    first = engine.submit(prompts[0], SamplingParams(max_new_tokens=5), on_tokens=listen)
    other = engine.submit(prompts[1], SamplingParams(max_new_tokens=9))
    engine.run_until_done()
    assert first.finish_reason == "length" and first.error is None  # it had ended: its tokens are whole
    assert other.tokens == _alone(target, "ngram", prompts[1], SamplingParams(max_new_tokens=9))
    assert ("raised on its listener's final call: ValueError in its listener (on_tokens): final call fault"
            in caplog.text)


def test_a_listener_that_always_raises_is_one_warning_line_and_its_traceback_is_debug_only(target, caplog):
    engine = Engine(target, "ngram", max_batch=2)
    prompts = _prompts(2, seed=23)

    def listen(req, new):
        raise KeyError("listener broke")

    caplog.set_level(logging.DEBUG, logger="specdec.serving.engine")
    bad = engine.submit(prompts[0], SamplingParams(max_new_tokens=6), on_tokens=listen, request_id="bad-1")
    engine.submit(prompts[1], SamplingParams(max_new_tokens=6))
    engine.run_until_done()
    assert bad.finish_reason == "error" and bad.error.stage == "listener"
    records = [r for r in caplog.records if r.name == "specdec.serving.engine"]
    warnings = [r for r in records if r.levelno >= logging.WARNING]
    assert [r.getMessage() for r in warnings] == ["request bad-1 ends with an error: KeyError in its listener "
                                                  "(on_tokens): 'listener broke'"]
    assert not any(r.exc_info for r in warnings)
    assert any(r.exc_info and r.levelno == logging.DEBUG for r in records)  # the traceback, for debugging


def _poisoned(target, token: int):
    """A copy of `target` whose embedding of `token` is NaN: a row that feeds it gets NaN logits."""
    model = copy.deepcopy(target)
    assert model.lm_head.weight is not model.embed.weight
    with torch.no_grad():
        model.embed.weight[token] = float("nan")
    return model


def test_nan_logits_of_one_row_end_that_request_only(target):
    """The victim emits a token whose embedding is NaN: its next verification raises (NaN logits).
    Its greedy group is verified again row by row, so the other greedy rows and the sampled row go
    on; a request that joins the victim's row later decodes as it does alone."""
    prompts = _prompts(6, seed=23)
    params = [SamplingParams(max_new_tokens=16), SamplingParams(max_new_tokens=16),
              SamplingParams(max_new_tokens=16, temperature=0.7, seed=3)] + [SamplingParams(max_new_tokens=10)] * 3
    clean = [_alone(target, "ngram", p, s) for p, s in zip(prompts, params)]
    rng = random.Random(23)
    victim = rng.randrange(2)
    seen = {t for i, (p, out) in enumerate(zip(prompts, clean)) if i != victim for t in p.tolist() + out}
    poison = next(t for t in clean[victim][rng.randint(2, 6):] if t not in seen and t not in prompts[victim])
    model = _poisoned(target, poison)
    engine = Engine(model, "ngram", max_batch=3)
    reqs = [engine.submit(p, s) for p, s in zip(prompts, params)]
    engine.run_until_done()
    bad = reqs[victim]
    assert bad.finish_reason == "error" and bad.error.stage == "sampling"
    assert bad.error.type == "NonFiniteLogitsError" and "NaN" in bad.error.message
    assert poison in bad.tokens and bad.tokens == clean[victim][:len(bad.tokens)]
    for i, req in enumerate(reqs):
        if i != victim:
            assert req.finish_reason == "length" and req.tokens == clean[i], i
    assert engine.metrics["finished_error"] == 1


class _AdmitFault(NgramDrafter):
    """N-gram drafts; admitting the prompt `bad` raises."""

    def __init__(self, bad: torch.Tensor) -> None:
        super().__init__()
        self.bad = bad

    def admit(self, row, prompt, hidden):
        if torch.equal(prompt, self.bad):
            raise KeyError(f"no room for prompt {prompt[:3].tolist()}")
        super().admit(row, prompt, hidden)


def test_a_drafter_that_cannot_admit_one_row_ends_that_request_only(target):
    """Three requests admitted in one prefill; the drafter's admit raises for one: the others are
    admitted again one by one (a sampled one's generator rewound) and decode as they do alone."""
    prompts = _prompts(3, seed=24)
    victim = random.Random(24).randrange(3)
    drafter = _AdmitFault(prompts[victim])
    params = [SamplingParams(max_new_tokens=12), SamplingParams(max_new_tokens=12, temperature=0.9, seed=8),
              SamplingParams(max_new_tokens=12)]
    engine = Engine(target, drafter, max_batch=3)
    reqs = [engine.submit(p, s) for p, s in zip(prompts, params)]
    engine.run_until_done()
    assert reqs[victim].finish_reason == "error" and reqs[victim].tokens == []
    assert (reqs[victim].error.stage, reqs[victim].error.type) == ("admission", "KeyError")
    for i, (req, p, s) in enumerate(zip(reqs, prompts, params)):
        if i != victim:
            assert req.finish_reason == "length" and req.tokens == _alone(target, NgramDrafter(), p, s), i


class _ReleaseFault(NgramDrafter):
    """N-gram drafts; releasing a row raises once."""

    failed = False

    def release(self, row):
        if not self.failed:
            self.failed = True
            raise OSError("release fault")


def test_a_release_that_raises_ends_its_request_with_the_error_and_frees_the_row(target):
    engine = Engine(target, _ReleaseFault(), max_batch=1)
    prompts = _prompts(2, seed=25)
    first = engine.submit(prompts[0], SamplingParams(max_new_tokens=6))
    second = engine.submit(prompts[1], SamplingParams(max_new_tokens=6))
    engine.run_until_done()
    assert first.finish_reason == "error" and first.error.stage == "release" and len(first.tokens) == 6
    assert second.finish_reason == "length"
    assert second.tokens == _alone(target, "ngram", prompts[1], SamplingParams(max_new_tokens=6))


class _ProposeFault(NgramDrafter):
    """N-gram drafts; the `fail_at`-th proposal for the batch raises."""

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.fail_at, self.calls = fail_at, 0

    def propose(self, seqs, k, rows):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("propose fault")
        return super().propose(seqs, k, rows)


def test_a_failed_shared_step_ends_the_requests_in_flight_and_the_engine_serves_on(target):
    fail_at = random.Random(26).randint(2, 4)
    engine = Engine(target, _ProposeFault(fail_at), max_batch=2)
    prompts = _prompts(4, seed=26)
    params = SamplingParams(max_new_tokens=20)
    reqs = [engine.submit(p, params) for p in prompts]
    engine.run_until_done()
    assert [r.finish_reason for r in reqs] == ["error", "error", "length", "length"]
    assert {(r.error.stage, r.error.message) for r in reqs[:2]} == {("step", "propose fault")}
    for req, p in zip(reqs[2:], prompts[2:]):
        assert req.tokens == specdec.generate(target, [p], max_new_tokens=20).sequences[0][p.numel():].tolist()
    assert engine.metrics["finished_error"] == 2 and engine.running == 0
