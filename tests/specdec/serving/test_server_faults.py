"""specdec serve under faults, over real HTTP on a tiny checkpoint: requests failing at random steps
get OpenAI's error (a 500, or a stream's error event then [DONE]) while the others answer what they
answer alone and /health stays up; clients that go away mid-body or mid-stream leave no traceback.

Faults are injected in the test process only: the engine here wraps the listener of the requests
whose prompt the test picked (nothing a client could reach)."""

from __future__ import annotations

import http.client
import json
import logging
import random
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import runtime
from specdec.serving.engine import Engine, SamplingParams
from specdec.serving.server import ServerThread, create_app
from tests.specdec.serving.conftest import MODEL, get, greedy, post

MAX_LEN = 256
MAX_TOKENS = 24
NUM_DRAFT = 3  # n-gram drafts per step: a step emits at most NUM_DRAFT + 1 tokens


class _FaultyEngine(Engine):
    """An engine whose requests with a prompt in `fail_at` get a listener that raises on its
    fail_at[prompt]-th call with tokens (then passes the final call on, as a listener may)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fail_at: dict[tuple[int, ...], int] = {}

    def submit(self, prompt_ids, params=SamplingParams(), *, on_tokens=None, request_id=None):
        call = self.fail_at.get(tuple(torch.as_tensor(prompt_ids).tolist()))
        if call is not None:
            on_tokens = _raising(on_tokens, call)
        return super().submit(prompt_ids, params, on_tokens=on_tokens, request_id=request_id)


def _raising(listener, call: int):
    calls = [0]

    def on_tokens(req, new):
        if new:
            calls[0] += 1
            if calls[0] == call:
                raise RuntimeError(f"injected fault at call {call}")
        listener(req, new)

    return on_tokens


@pytest.fixture(scope="module")
def served(ckpt):
    """(server, target, tokenizer, engine): a faulty engine of 4 rows behind the app."""
    target = runtime.load_model(ckpt, dtype=torch.float32)
    tok = runtime.load_tokenizer(ckpt)
    engine = _FaultyEngine(target, "ngram", max_batch=4, max_len=MAX_LEN, num_draft_tokens=NUM_DRAFT,
                           eos_token_id=tok.eos_token_id)
    with ServerThread(create_app(engine, tok, MODEL)) as server:
        yield server, target, tok, engine


@pytest.fixture
def records():
    """Log records of uvicorn and specdec (INFO and up) while the test runs."""
    caught: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            caught.append(record)

    handler = Keep(logging.INFO)
    loggers = [logging.getLogger(name) for name in ("uvicorn", "uvicorn.error", "specdec")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.INFO)
    yield caught
    for lg, level in zip(loggers, levels):
        lg.removeHandler(handler)
        lg.setLevel(level)


def _tracebacks(records: list[logging.LogRecord]) -> list[str]:
    return [r.getMessage() for r in records if r.exc_info or "Traceback" in r.getMessage()]


def _stream(server, body: dict) -> list:
    """The events of a streamed completion: parsed JSON objects, and "[DONE]"."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    events = []
    for line in resp.read().decode().splitlines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    conn.close()
    return events


def _metric(server, name: str, label: str) -> float:
    found = re.search(rf'^{name}\{{{label}\}} ([0-9.e+]+)$', get(server, "/metrics")[1], re.M)
    return float(found.group(1)) if found else 0.0


def test_sixteen_requests_four_at_once_two_failing_at_random_steps(served):
    server, target, tok, engine = served
    g = torch.Generator().manual_seed(51)
    prompts = []
    while len(prompts) < 16:  # distinct prompts of 4 to 9 ids, no special tokens
        ids = torch.randint(5, 128, (int(torch.randint(4, 10, (1,), generator=g)),), generator=g).tolist()
        if tok.eos_token_id not in ids and ids not in prompts:
            prompts.append(ids)
    want = [greedy(target, p, MAX_TOKENS, tok.eos_token_id) for p in prompts]
    # a request of >= 13 tokens takes >= 4 listener calls (1 token at admission, <= NUM_DRAFT + 1 a step)
    long = [i for i in range(16) if len(want[i]) >= 13]
    rng = random.Random(51)
    failing = {rng.choice([i for i in long if i % 2 == 0]): rng.randint(1, 3),  # answered whole
               rng.choice([i for i in long if i % 2 == 1]): rng.randint(1, 3)}  # streamed
    engine.fail_at = {tuple(prompts[i]): call for i, call in failing.items()}
    errors_before = _metric(server, "specdec_requests_total", 'finish_reason="error"')

    health: list[int] = []
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            health.append(get(server, "/health")[0])
            time.sleep(0.01)

    def ask(i: int):
        body = {"model": MODEL, "prompt": prompts[i], "max_tokens": MAX_TOKENS, "temperature": 0}
        return ("stream", _stream(server, body)) if i % 2 else ("plain", post(server, "/v1/completions", body))

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        with ThreadPoolExecutor(max_workers=4) as pool:
            results = list(pool.map(ask, range(16)))
    finally:
        done.set()
        poller.join()
    assert len(health) >= 3 and set(health) == {200}

    ids = set()
    for i, (kind, got) in enumerate(results):
        text = tok.decode(want[i], skip_special_tokens=True)
        if kind == "plain":
            status, body = got
            if i in failing:
                assert status == 500 and set(body) == {"error"}
                assert set(body["error"]) == {"message", "type", "param", "code"}
                assert (body["error"]["type"], body["error"]["code"]) == ("server_error", "request_failed")
                assert f"injected fault at call {failing[i]}" in body["error"]["message"]
                continue
            assert status == 200 and body["choices"][0]["text"] == text, i
            assert body["usage"]["completion_tokens"] == len(want[i])
            ids.add(body["id"])
        else:
            assert got[-1] == "[DONE]" and "[DONE]" not in got[:-1]
            chunks = got[:-1]
            if i in failing:
                assert "error" in chunks[-1] and chunks[-1]["error"]["code"] == "request_failed"
                assert f"injected fault at call {failing[i]}" in chunks[-1]["error"]["message"]
                assert all("error" not in c and c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
                continue
            assert all("error" not in c for c in chunks)
            assert "".join(c["choices"][0]["text"] for c in chunks) == text, i
            assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
            ids |= {c["id"] for c in chunks}
    assert len(ids) == 14  # one reply per request: none lost, none answered twice
    assert _metric(server, "specdec_requests_total", 'finish_reason="error"') == errors_before + 2
    assert _metric(server, "specdec_failed_requests_total", 'code="request_failed"') >= 2
    assert engine.running == 0 and engine.waiting == 0


def _wait_for(check, seconds: float = 20.0) -> bool:
    deadline = time.monotonic() + seconds
    while not check() and time.monotonic() < deadline:
        time.sleep(0.05)
    return check()


def _raw_post(server, body: bytes, send: int) -> socket.socket:
    """A POST whose headers announce `body` whole, of which only the first `send` bytes are sent."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    sock.sendall(head + body[:send])
    return sock


def test_clients_that_leave_mid_body_or_mid_stream_leave_no_traceback(served, records):
    server, _, _, engine = served
    engine.fail_at = {}
    body = json.dumps({"model": MODEL, "prompt": [7, 8, 9, 10], "max_tokens": 200, "temperature": 0}).encode()
    sock = _raw_post(server, body, send=len(body) // 2)
    time.sleep(0.2)  # the server is reading the body when the client goes
    sock.close()
    assert _wait_for(lambda: any("before its request arrived whole" in r.getMessage() for r in records))
    assert engine.running == 0 and engine.waiting == 0  # nothing was queued

    cancelled = _metric(server, "specdec_requests_total", 'finish_reason="cancelled"')
    streamed = json.dumps({**json.loads(body), "stream": True}).encode()
    sock = _raw_post(server, streamed, send=len(streamed))
    received = b""
    while b"data: {" not in received:  # the stream has begun
        chunk = sock.recv(4096)
        assert chunk, received
        received += chunk
    sock.close()
    assert _wait_for(lambda: _metric(server, "specdec_requests_total", 'finish_reason="cancelled"') == cancelled + 1)
    assert _wait_for(lambda: engine.running == 0 and engine.waiting == 0)  # its row is free
    assert post(server, "/v1/completions", {"model": MODEL, "prompt": [7, 8], "max_tokens": 4})[0] == 200
    assert _tracebacks(records) == []
    assert sum("disconnected mid-stream" in r.getMessage() for r in records) == 1
