"""specdec serve: the HTTP server on a tiny checkpoint, driven by the real openai client and raw HTTP.

A uvicorn server on a free loopback port serves a tiny random Llama (float32, n-gram drafter,
batches of up to 4). Greedy answers must equal specdec.generate on the prompt alone; bad requests
get OpenAI's error JSON with a 4xx status and the server keeps serving; concurrent requests all
finish once; a client that drops its stream cancels its request; stop strings end the text before
them; n choices are rows of the batch, choice i sampled as a request with seed + i.
"""

from __future__ import annotations

import argparse
import http.client
import json
import re
import threading
import time
from types import SimpleNamespace

import pytest
import torch

import runtime
import specdec
from specdec.cli import main as cli_main
from specdec.drafters import EagleTreeConfig
from specdec.drafters.ngram import NgramDrafter
from specdec.serving.command import load_drafter
from specdec.serving.command import register as register_serve
from specdec.serving.engine import Engine
from specdec.serving.server import ServerThread, create_app, serve_while
from tests.specdec.serving.conftest import MAX_LEN, MODEL, PROMPTS, get, greedy, post

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def served(ckpt):
    """(server, target, tokenizer, engine): the app running in a thread, torn down after the module."""
    target = runtime.load_model(ckpt, dtype=torch.float32)
    tok = runtime.load_tokenizer(ckpt)
    engine = Engine(target, "ngram", max_batch=4, max_len=MAX_LEN, num_draft_tokens=3,
                    eos_token_id=tok.eos_token_id)
    with ServerThread(create_app(engine, tok, MODEL, max_model_len=MAX_LEN)) as server:
        yield server, target, tok, engine


def client(server) -> "openai.OpenAI":
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def chat_ids(tok, text: str) -> list[int]:
    rendered = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                       tokenize=False)
    return tok(rendered, add_special_tokens=False)["input_ids"]


def test_openai_client_streams_a_completion_and_a_chat_completion(served):
    server, target, tok, _ = served
    c = client(server)
    ids = tok(PROMPTS[1])["input_ids"]
    want = greedy(target, ids, 20, tok.eos_token_id)
    stream = c.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=20, temperature=0, stream=True,
                                  stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == tok.decode(want, skip_special_tokens=True)
    assert len(chunks) > 3  # streamed step by step, not in one piece
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] in ("stop", "length")
    assert chunks[-1].usage.completion_tokens == len(want) and chunks[-1].usage.prompt_tokens == len(ids)

    want = greedy(target, chat_ids(tok, PROMPTS[2]), 16, tok.eos_token_id)
    stream = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[2]}],
                                       max_tokens=16, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == tok.decode(want, skip_special_tokens=True)
    assert chunks[-1].choices[0].finish_reason == ("stop" if want[-1] == tok.eos_token_id else "length")


def test_serve_while_steps_the_engine_on_this_thread_and_returns_what_the_work_returns(ckpt):
    """A load test's clients run in a background thread while the engine steps on the calling (main)
    thread, as `specdec serve` runs it; the work's result or exception comes back."""
    target, tok = runtime.load_model(ckpt, dtype=torch.float32), runtime.load_tokenizer(ckpt)
    engine = Engine(target, "ngram", max_batch=2, max_len=MAX_LEN, num_draft_tokens=3, eos_token_id=tok.eos_token_id)
    threads, step = set(), engine.step

    def recorded_step():
        threads.add(threading.current_thread())
        return step()

    engine.step = recorded_step
    ids = tok(PROMPTS[3])["input_ids"]

    def work(port: int) -> tuple[int, dict]:
        return post(SimpleNamespace(port=port), "/v1/completions",
                    {"model": MODEL, "prompt": ids, "max_tokens": 9, "temperature": 0})

    status, body = serve_while(create_app(engine, tok, MODEL, max_model_len=MAX_LEN), work)
    assert status == 200 and body["choices"][0]["text"] == tok.decode(greedy(target, ids, 9, tok.eos_token_id),
                                                                      skip_special_tokens=True)
    assert threads == {threading.current_thread()}

    def failing(port: int) -> None:
        raise RuntimeError(f"the clients of port {port} failed")

    with pytest.raises(RuntimeError, match="the clients of port"):
        serve_while(create_app(engine, tok, MODEL, max_model_len=MAX_LEN), failing)


def test_answers_equal_generate_with_usage_and_finish_reason(served):
    server, target, tok, _ = served
    c = client(server)
    ids = tok(PROMPTS[0])["input_ids"]
    want = greedy(target, ids, 12, tok.eos_token_id)
    assert want[-1] == tok.eos_token_id and len(want) == 4  # the checkpoint's eos ends this answer
    got = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0)
    assert got.choices[0].text == tok.decode(want, skip_special_tokens=True)
    assert got.choices[0].finish_reason == "stop"
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(ids), 4)

    ids = tok(PROMPTS[3])["input_ids"]
    want = greedy(target, ids, 9, tok.eos_token_id)
    status, body = post(server, "/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 9,
                                                     "temperature": 0})
    assert status == 200 and body["object"] == "text_completion"
    assert body["choices"][0]["text"] == tok.decode(want, skip_special_tokens=True)
    assert body["choices"][0]["finish_reason"] == ("stop" if want[-1] == tok.eos_token_id else "length")

    want = greedy(target, chat_ids(tok, PROMPTS[4]), 10, tok.eos_token_id)
    got = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[4]}],
                                    max_tokens=10, temperature=0)
    assert got.choices[0].message.content == tok.decode(want, skip_special_tokens=True)
    assert got.usage.completion_tokens == len(want)


def test_a_seed_makes_sampling_repeatable(served):
    server, _, _, _ = served
    c = client(server)
    texts = [c.completions.create(model=MODEL, prompt=PROMPTS[5], max_tokens=12, temperature=1.0, seed=7)
             .choices[0].text for _ in range(2)]
    assert texts[0] == texts[1]


def test_stop_strings_end_the_text_before_them_plain_and_streamed(served):
    server, target, tok, _ = served
    c = client(server)
    full = tok.decode(greedy(target, tok(PROMPTS[1])["input_ids"], 20, tok.eos_token_id), skip_special_tokens=True)
    words = full.split()
    assert len(words) >= 6, full
    stop = f"{words[3]} {words[4]}"
    want = full[:full.find(stop)]
    got = c.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=20, temperature=0, stop=[stop, "zzz"])
    assert (got.choices[0].text, got.choices[0].finish_reason) == (want, "stop")
    # tokens up to the one that completed the stop string, however many the last step accepted
    ids = greedy(target, tok(PROMPTS[1])["input_ids"], 20, tok.eos_token_id)
    upto = next(m for m in range(1, 21) if stop in tok.decode(ids[:m], skip_special_tokens=True))
    assert got.usage.completion_tokens == upto
    chunks = list(c.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=20, temperature=0, stop=stop,
                                       stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"
    got = c.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=20, temperature=0, stop="not in it")
    assert got.choices[0].text == full


def test_n_choices_are_rows_of_the_batch_and_each_follows_its_seed(served):
    server, target, tok, _ = served
    c = client(server)
    got = c.completions.create(model=MODEL, prompt=PROMPTS[6], max_tokens=8, temperature=1.0, seed=11, n=3)
    assert [ch.index for ch in got.choices] == [0, 1, 2]
    alone = [c.completions.create(model=MODEL, prompt=PROMPTS[6], max_tokens=8, temperature=1.0, seed=11 + i)
             for i in range(3)]
    assert [ch.text for ch in got.choices] == [a.choices[0].text for a in alone]
    assert got.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert got.usage.prompt_tokens == alone[0].usage.prompt_tokens

    messages = [{"role": "user", "content": PROMPTS[7]}]
    whole = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=1.0, seed=3, n=2)
    texts = {0: "", 1: ""}
    finish = {}
    for ch in c.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=1.0, seed=3, n=2,
                                        stream=True):
        choice = ch.choices[0]
        texts[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            finish[choice.index] = choice.finish_reason
    assert texts == {ch.index: ch.message.content for ch in whole.choices}
    assert finish == {ch.index: ch.finish_reason for ch in whole.choices}
    greedy_two = c.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=5, temperature=0, n=2)
    assert greedy_two.choices[0].text == greedy_two.choices[1].text


GOOD = {"model": MODEL, "prompt": "hello world", "max_tokens": 4, "temperature": 0}
BAD = [  # (path, body, status, param, code)
    ("/v1/completions", {**GOOD, "model": "gpt-4"}, 404, "model", "model_not_found"),
    ("/v1/completions", {**GOOD, "max_tokens": -3}, 400, "max_tokens", "invalid_value"),
    ("/v1/completions", {**GOOD, "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ("/v1/completions", {**GOOD, "max_tokens": "ten"}, 400, "max_tokens", "invalid_type"),
    ("/v1/completions", b'{"model": "tiny-llama", "prompt": ', 400, None, "invalid_json"),
    ("/v1/completions", b'["a list"]', 400, None, "invalid_json"),
    ("/v1/completions", {"model": MODEL, "max_tokens": 4}, 400, "prompt", "missing_required_parameter"),
    ("/v1/completions", {"prompt": "hello", "max_tokens": 4}, 400, "model", "missing_required_parameter"),
    ("/v1/chat/completions", {"model": MODEL, "max_tokens": 4}, 400, "messages", "missing_required_parameter"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages",
     "invalid_value"),
    ("/v1/completions", {**GOOD, "prompt": "x " * MAX_LEN}, 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", {**GOOD, "max_tokens": MAX_LEN}, 400, "max_tokens", "context_length_exceeded"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x " * MAX_LEN}]}, 400,
     "messages", "context_length_exceeded"),
    ("/v1/completions", {**GOOD, "prompt": [5, 999]}, 400, "prompt", "invalid_value"),
    ("/v1/completions", {**GOOD, "temperature": -0.5}, 400, "temperature", "invalid_value"),
    ("/v1/completions", {**GOOD, "temperature": 3}, 400, "temperature", "invalid_value"),
    ("/v1/completions", {**GOOD, "temperature": "hot"}, 400, "temperature", "invalid_type"),
    ("/v1/completions", {**GOOD, "top_p": 0}, 400, "top_p", "invalid_value"),
    ("/v1/completions", {**GOOD, "n": 0}, 400, "n", "invalid_value"),
    ("/v1/completions", {**GOOD, "best_of": 2}, 400, "best_of", "unsupported_parameter"),
    ("/v1/completions", {**GOOD, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "invalid_value"),
    ("/v1/completions", {**GOOD, "prompt": ["a", "b"]}, 400, "prompt", "invalid_value"),
    ("/v1/completions", {**GOOD, "foo": 1}, 400, "foo", "unknown_parameter"),
    ("/v1/completions", {**GOOD, "stop_token_ids": [999]}, 400, "stop_token_ids", "unknown_parameter"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "foo": 1}, 400, "foo",
     "unknown_parameter"),
    ("/v1/completions", {**GOOD, "seed": -1}, 400, "seed", "invalid_value"),
    ("/v1/completions", {**GOOD, "seed": 2 ** 70}, 400, "seed", "invalid_value"),
    ("/v1/completions", b"[" * 100000 + b"]" * 100000, 400, None, "invalid_json"),
    ("/v1/completions", b'{"model": "tiny-llama", "prompt": [' + b"7" * 5000 + b']}', 400, None, "invalid_json"),
    ("/v1/nothing", GOOD, 404, None, "404"),
    # lone surrogates: valid JSON escapes, but no text for the tokenizer or a UTF-8 reply
    ("/v1/completions", {**GOOD, "prompt": "\ud800abc"}, 400, "prompt", "invalid_value"),
    ("/v1/completions", {**GOOD, "prompt": ["hello \udfff"]}, 400, "prompt", "invalid_value"),
    ("/v1/completions", {**GOOD, "stop": ["a", "\ud83d"]}, 400, "stop", "invalid_value"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"},
                                                           {"role": "user", "content": "\ud800abc"}]}, 400,
     "messages", "invalid_value"),
]


@pytest.mark.parametrize("path,body,status,param,code", BAD, ids=[f"{b[4]}-{b[3]}-{i}" for i, b in enumerate(BAD)])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(served, path, body, status, param, code):
    server = served[0]
    got_status, got = post(server, path, body)
    assert got_status == status
    assert set(got) == {"error"} and set(got["error"]) == {"message", "type", "param", "code"}
    assert (got["error"]["param"], got["error"]["code"], got["error"]["type"]) == (param, code,
                                                                                   "invalid_request_error")
    assert len(got["error"]["message"]) > 20
    ok_status, ok = post(server, "/v1/completions", GOOD)
    assert ok_status == 200 and ok["usage"]["completion_tokens"] >= 1


def test_openai_client_raises_on_an_unknown_model(served):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client(served[0]).completions.create(model="nope", prompt="hello", max_tokens=2)


def test_models_health_and_metrics(served):
    server = served[0]
    models = client(server).models.list()
    assert [m.id for m in models.data] == [MODEL]
    status, text = get(server, "/health")
    assert status == 200 and json.loads(text)["status"] == "ok"
    post(server, "/v1/completions", GOOD)
    for prompt in PROMPTS:  # enough text for the n-gram drafter to propose
        post(server, "/v1/completions", {**GOOD, "prompt": prompt, "max_tokens": 24})
    status, text = get(server, "/metrics")
    assert status == 200
    for name in ("specdec_time_to_first_token_seconds_bucket", "specdec_time_per_output_token_seconds_bucket",
                 "specdec_queue_length", "specdec_running_rows", "specdec_acceptance_rate", "specdec_tau"):
        assert name in text
    def value(name: str) -> float:
        return float(re.search(rf"^{name} ([0-9.e+]+)$", text, re.M).group(1))

    assert value("specdec_generated_tokens_total") >= 4
    assert value("specdec_time_to_first_token_seconds_count") >= 1
    assert value("specdec_time_per_output_token_seconds_count") >= 1
    assert 0 < value("specdec_tau") and 0 <= value("specdec_acceptance_rate") <= 1
    steps = re.search(r'^specdec_drafter_steps_total\{drafter="ngram"\} ([0-9.e+]+)$', text, re.M)
    assert steps and float(steps.group(1)) >= 1
    assert 'specdec_drafter_acceptance_rate{drafter="ngram"}' in text


def test_concurrent_requests_all_finish_once(served):
    server, target, tok, _ = served
    results: dict[int, list] = {i: [] for i in range(len(PROMPTS))}

    def ask(i: int) -> None:
        status, body = post(server, "/v1/completions", {"model": MODEL, "prompt": PROMPTS[i], "max_tokens": 24,
                                                         "temperature": 0})
        results[i].append((status, body))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    ids = set()
    for i, prompt in enumerate(PROMPTS):
        assert len(results[i]) == 1
        status, body = results[i][0]
        assert status == 200
        want = greedy(target, tok(prompt)["input_ids"], 24, tok.eos_token_id)
        assert body["choices"][0]["text"] == tok.decode(want, skip_special_tokens=True), prompt
        ids.add(body["id"])
    assert len(ids) == len(PROMPTS)


def _cancelled(server) -> float:
    text = get(server, "/metrics")[1]
    found = re.search(r'^specdec_requests_total\{finish_reason="cancelled"\} ([0-9.e+]+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def test_a_client_that_drops_its_stream_cancels_the_request(served):
    server, target, tok, engine = served
    prompt = next(p for p in PROMPTS if tok.eos_token_id not in greedy(target, tok(p)["input_ids"], 200,
                                                                       tok.eos_token_id))
    before = _cancelled(server)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_LEN - 8, "temperature": 0, "stream": True}
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: {")
    conn.close()
    deadline = time.monotonic() + 20
    while _cancelled(server) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _cancelled(server) == before + 1
    while (engine.running or engine.waiting) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.running == 0 and engine.waiting == 0
    assert post(server, "/v1/completions", GOOD)[0] == 200


def test_serve_builds_the_eagle_tree_from_its_flags(ckpt, tmp_path, capsys):
    target = runtime.load_model(ckpt, dtype=torch.float32)
    torch.manual_seed(0)
    specdec.save_eagle(specdec.Eagle3Head(specdec.Eagle3Config.from_target(target, aux_layers=(0, 1, 1))),
                       tmp_path / "eagle")
    parser = argparse.ArgumentParser(prog="specdec")
    register_serve(parser.add_subparsers(dest="command"))
    base = ["serve", "--model", str(ckpt), "--eagle", str(tmp_path / "eagle"), "--eagle-depth", "3",
            "--eagle-top-k", "2"]
    drafter = load_drafter(parser.parse_args([*base, "--eagle-tree", "6"]), target)
    assert drafter.tree == EagleTreeConfig(3, 2, 6)
    drafter = load_drafter(parser.parse_args([*base, "--eagle-tree", "auto"]), target)
    assert drafter.tree.total_tokens in (2, 4, 8)  # the sizes a 3 x 2 tree (10 candidates) can hold
    assert "chosen: " in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--eagle-tree", "0"])
    wide = ["serve", "--model", str(ckpt), "--eagle", str(tmp_path / "eagle"), "--eagle-depth", "4", "--eagle-top-k",
            "5", "--eagle-tree", "80"]  # tree nodes are no draft length (capped at 64): a 4 x 5 tree holds 80
    assert load_drafter(parser.parse_args(wide), target).tree == EagleTreeConfig(4, 5, 80)
    with pytest.raises(ValueError, match="exceeds the 80 candidates"):
        load_drafter(parser.parse_args([*wide[:-1], "81"]), target)


def test_generate_cli_drafts_with_an_eagle_head_or_medusa_heads(ckpt, tmp_path, capsys):
    target = runtime.load_model(ckpt, dtype=torch.float32)
    tok = runtime.load_tokenizer(ckpt)
    torch.manual_seed(0)
    specdec.save_eagle(specdec.Eagle3Head(specdec.Eagle3Config.from_target(target, aux_layers=(0, 1, 1))),
                       tmp_path / "eagle")
    want = tok.decode(greedy(target, chat_ids(tok, PROMPTS[3]), 8, tok.eos_token_id), skip_special_tokens=True)
    base = ["generate", "--model", str(ckpt), "--prompt", PROMPTS[3], "--dtype", "float32", "--max-new-tokens", "8"]
    for extra in (["--eagle", str(tmp_path / "eagle"), "--eagle-tree", "4"], ["--draft", "ngram"], []):
        capsys.readouterr()
        assert cli_main([*base, *extra]) == 0
        out = capsys.readouterr().out
        assert out.startswith(want) and "| tau" in out  # the streamed text (greedy = plain), then the stats


def test_serve_fails_fast_on_a_bad_model_path(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SPECDEC_DEBUG", raising=False)
    assert cli_main(["serve", "--model", str(tmp_path / "missing"), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("specdec serve: error:") and "missing" in err[0]


def test_serve_fails_fast_on_a_taken_port(served, capsys, monkeypatch):
    monkeypatch.delenv("SPECDEC_DEBUG", raising=False)
    assert cli_main(["serve", "--model", "unused", "--port", str(served[0].port)]) == 2
    assert "pick another --port" in capsys.readouterr().err


@pytest.mark.parametrize("flags,named,hint", [
    (["--host", ""], "--host is empty", "0.0.0.0 to listen on all interfaces"),
    (["--host", "  "], "--host is empty", "0.0.0.0 to listen on all interfaces"),
    (["--served-model-name", ""], "--served-model-name is empty", "pass a name"),
])
def test_serve_refuses_an_empty_host_or_served_model_name_before_loading(tmp_path, capsys, monkeypatch, flags,
                                                                         named, hint):
    monkeypatch.delenv("SPECDEC_DEBUG", raising=False)
    assert cli_main(["serve", "--model", str(tmp_path / "missing"), "--port", "0", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"specdec serve: error: {named}") and hint in err[0]


class _FailingDrafter(NgramDrafter):
    """An n-gram drafter whose proposals fail: every batch step raises inside the engine."""

    def propose(self, seqs, k, rows):
        raise RuntimeError("drafter exploded")


def test_a_failed_batch_step_answers_its_requests_500_and_the_server_serves_on(ckpt):
    target = runtime.load_model(ckpt, dtype=torch.float32)
    tok = runtime.load_tokenizer(ckpt)
    engine = Engine(target, _FailingDrafter(), max_batch=2, max_len=64, eos_token_id=tok.eos_token_id)
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}
    with ServerThread(create_app(engine, tok, MODEL)) as server:
        for _ in range(2):
            status, payload = post(server, "/v1/completions", body)
            assert status == 500 and "drafter exploded" in payload["error"]["message"]
            assert (payload["error"]["code"], payload["error"]["type"]) == ("request_failed", "server_error")
            assert get(server, "/health")[0] == 200


class _BrokenEngine(Engine):
    """An engine whose step itself raises (a fault outside the requests the engine isolates)."""

    def step(self):
        raise RuntimeError("engine bookkeeping broke")


def test_a_step_that_raises_out_of_the_engine_answers_500_and_later_requests_503(ckpt):
    target = runtime.load_model(ckpt, dtype=torch.float32)
    tok = runtime.load_tokenizer(ckpt)
    engine = _BrokenEngine(target, "ngram", max_batch=2, max_len=64, eos_token_id=tok.eos_token_id)
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}
    with ServerThread(create_app(engine, tok, MODEL)) as server:
        status, payload = post(server, "/v1/completions", body)
        assert status == 500 and "engine bookkeeping broke" in payload["error"]["message"]
        assert payload["error"]["code"] == "engine_failed"
        status, payload = post(server, "/v1/completions", body)
        assert status == 503 and "restart the server" in payload["error"]["message"]
        assert get(server, "/health")[0] == 503


def test_a_server_thread_on_a_taken_port_fails_and_leaves_no_thread(served):
    from fastapi import FastAPI

    server = ServerThread(FastAPI(), port=served[0].port)
    with pytest.raises(RuntimeError, match="did not start on 127.0.0.1"):
        server.start(timeout_s=20)
    assert not server._thread.is_alive()


@pytest.mark.real_model
def test_openai_client_streams_from_smollm2_as_generate_decodes():
    """The real byte-level tokenizer and chat template: streamed text (non-ASCII too) equals generate()."""
    from specdec.evaluation.evaluate import eos_ids

    name = "smollm2-135m-instruct"
    target = runtime.load_model(name, dtype=torch.float32)
    tok = runtime.load_tokenizer(name)
    eos = eos_ids(name, tok)
    engine = Engine(target, "ngram", max_batch=2, max_len=512, eos_token_id=eos)
    messages = [{"role": "user", "content": "Repeat exactly: こんにちは 世界"}]  # characters split over tokens
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok(ids, add_special_tokens=False)["input_ids"]
    out = specdec.generate(target, [torch.tensor(ids)], max_new_tokens=32, eos_token_id=eos)
    want = tok.decode(out.sequences[0][len(ids):], skip_special_tokens=True)
    with ServerThread(create_app(engine, tok, name)) as server:
        stream = client(server).chat.completions.create(model=name, messages=messages, max_tokens=32,
                                                        temperature=0, stream=True)
        got = "".join(ch.choices[0].delta.content or "" for ch in stream)
    assert got == want and "こんにちは" in got and "\ufffd" not in got


def test_a_resent_conversation_is_served_from_the_prefix_cache(served):
    """A chat client resends the whole conversation each turn: the second turn copies the first
    turn's blocks (prompt and answer) instead of prefilling them, and /metrics says so."""
    server = served[0]

    def value(name: str) -> float:
        return float(re.search(rf"^{name} ([0-9.e+]+)$", get(server, "/metrics")[1], re.M).group(1))

    messages = [{"role": "system", "content": "print the world of x " * 8}, {"role": "user", "content": "hello world"}]
    status, first = post(server, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 8,
                                                           "temperature": 0})
    assert status == 200
    hits, blocks = value("specdec_prefix_cache_hit_tokens_total"), value('specdec_prefix_cache_blocks{state="cached"}')
    messages += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "def x"}]
    status, _ = post(server, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 8,
                                                       "temperature": 0})
    assert status == 200
    assert value("specdec_prefix_cache_hit_tokens_total") >= hits + 32 and blocks >= 2
    assert value("specdec_prefill_tokens_total") > 0 and value("specdec_kv_tokens_capacity") > 0
    assert value("specdec_preemptions_total") == 0 and value('specdec_kv_blocks{state="free"}') > 0


def test_n_samples_share_the_prompts_blocks_of_a_paged_cache(ckpt):
    """On a paged KV cache the n samples of a prompt hold its full blocks once, by reference, while
    they run; their answers follow their seeds as on per-row slots."""
    target = runtime.load_model(ckpt, dtype=torch.float32)
    tok = runtime.load_tokenizer(ckpt)
    engine = Engine(target, "ngram", max_batch=4, max_len=MAX_LEN, num_draft_tokens=3,
                    eos_token_id=tok.eos_token_id, kv_cache_tokens=4 * MAX_LEN)
    prompt = "return the x of a " * 9 + "hello"  # 46 words: two full blocks shared
    shared = []

    def watch(req, new):  # on the stepping thread: the first block of every row holding the prompt
        table, lengths = engine.loop.cache.block_table, engine.loop.cache.lengths
        rows = [b for b, r in enumerate(engine.slots) if r is not None and lengths[b] > 0]
        shared.append((len(rows), {int(table[b, 0]) for b in rows}))

    with ServerThread(create_app(engine, tok, MODEL, max_model_len=MAX_LEN)) as server:
        engine_submit = engine.submit
        engine.submit = lambda *a, **kw: engine_submit(*a, **{**kw, "on_tokens": _chain(kw.get("on_tokens"), watch)})
        got = client(server).completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=1.0, seed=5,
                                                n=4)
    assert len(got.choices) == 4 and max(n for n, _ in shared) == 4
    assert all(len(blocks) == 1 for n, blocks in shared if n)  # one first block for every row running
    assert engine.metrics["prefix_cache_hits"] >= 3


def _chain(first, second):
    """A listener calling `first` (if any), then `second`."""
    def both(req, new):
        if first is not None:
            first(req, new)
        second(req, new)
    return both


def test_n_samples_of_one_prompt_prefill_it_once_and_follow_their_seeds(served):
    """n choices are n requests of one prompt: the first prefills it, the others copy its blocks."""
    server = served[0]
    c = client(server)

    def value(name: str) -> float:
        return float(re.search(rf"^{name} ([0-9.e+]+)$", get(server, "/metrics")[1], re.M).group(1))

    prompt = "return the x of a " * 9 + "hello"  # 46 words: two full blocks shared
    hits, looked = value("specdec_prefix_cache_hits_total"), value("specdec_prefix_cache_lookups_total")
    hit_tokens = value("specdec_prefix_cache_hit_tokens_total")
    got = c.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=1.0, seed=5, n=4)
    assert value("specdec_prefix_cache_lookups_total") == looked + 4
    assert value("specdec_prefix_cache_hits_total") >= hits + 3  # the first may reuse earlier tests' tokens
    # the 3 later samples copy all of the prompt but the token that gives their logits
    assert value("specdec_prefix_cache_hit_tokens_total") - hit_tokens >= 3 * (got.usage.prompt_tokens - 1)
    again = c.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=1.0, seed=5, n=4)
    assert [ch.text for ch in again.choices] == [ch.text for ch in got.choices]


@pytest.mark.parametrize("stop,extra", [("SIGINT", []), ("SIGTERM", ["--kv-cache-tokens", "512"])])
def test_specdec_serve_answers_and_stops_on_ctrl_c(ckpt, tmp_path, stop, extra):
    """The command as a user runs it: HTTP in a background thread, the engine stepping on the main
    thread; a request is answered and SIGINT (Ctrl-C) or SIGTERM ends the process cleanly. It starts
    with SIGINT ignored, as a background job of a script does (Python then installs no Ctrl-C handler:
    it hung there once). Its output goes to a file; if it does not stop, faulthandler's stacks of
    every thread are in the failure message. The SIGTERM run serves from a paged KV cache."""
    import signal
    import subprocess
    import sys

    from specdec.evaluation.llamacpp import free_port, wait_healthy

    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-X", "faulthandler", "-m", "specdec.cli", "serve", "--model",
                                 str(ckpt), "--dtype", "float32", "--port", str(port), "--max-len", "128",
                                 "--log-level", "warning", *extra], stdout=out, stderr=subprocess.STDOUT, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, 120)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("POST", "/v1/completions", body=json.dumps({**GOOD, "model": str(ckpt)}),
                     headers={"Content-Type": "application/json"})
        reply = conn.getresponse()
        assert reply.status == 200 and json.loads(reply.read())["usage"]["completion_tokens"] >= 1
        proc.send_signal(getattr(signal, stop))
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)  # faulthandler prints every thread's stack
            proc.wait(timeout=30)
            pytest.fail(f"specdec serve did not stop within 30 s of {stop}; its output:\n{log.read_text()[-6000:]}")
        assert code == 0, log.read_text()[-3000:]
        if extra:
            assert "KV cache: paged, 512 positions in blocks of 16" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
