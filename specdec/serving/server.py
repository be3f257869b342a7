"""`specdec serve`'s HTTP server: OpenAI-compatible endpoints over a continuous-batching Engine.

One thread (`EngineLoop`) owns the engine and calls `engine.step()` while requests wait or run; it
sleeps on a condition when there is nothing to do. `serve` runs it on the main thread and uvicorn in
a background thread (the engine's OpenMP kernels run slower from a second thread); `create_app`
alone (tests, `ServerThread`) starts it in a background thread. The async handlers of the FastAPI
app submit requests (`Engine.submit` is thread-safe) with an `on_tokens` callback that, on the
engine thread, counts tokens for the metrics and hands each step's new ids to the handler's
asyncio queue through `loop.call_soon_threadsafe`. A client that disconnects (a closed stream, or
a plain request whose connection drops) has its request cancelled (`Engine.cancel`); one that goes
away before its body arrived whole gets nothing queued. Either is one info line in the log.

A request that ends with an error (the engine's finish reason "error": a fault of that request, or
of the batch's step; see specdec.serving.engine) or whose text handling raises gets OpenAI's error
object with status 500 (code "request_failed"), or, streamed, an error event and `data: [DONE]`;
the other requests are not affected.

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with `stream: true` as
server-sent events ending with `data: [DONE]`), GET /v1/models, GET /health, GET /metrics
(Prometheus). Refused requests get OpenAI's error JSON with a 4xx status (specdec.serving.protocol),
failed ones with a 5xx status.

`create_app(engine, tokenizer, model_name)` builds the app; `ServerThread` runs it with uvicorn
in a thread (tests); `serve(...)` runs it in the foreground; `serve_while(app, work)` serves while
`work` (a load test's clients) runs in a background thread, stepping the engine on the main thread
as `serve` does.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Callable, TypeVar

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from runtime.errors import ContextLengthError
from specdec.sampling import SamplingParams
from specdec.serving.metrics import ServerMetrics
from specdec.serving.protocol import (
    APIError,
    GenerationRequest,
    IncrementalText,
    chunk,
    new_id,
    now,
    parse_chat,
    parse_completion,
    response,
    usage_chunk,
)

log = logging.getLogger("specdec.serving.server")
T = TypeVar("T")
_DISCONNECT_POLL_S = 0.5  # how often a plain (not streamed) request checks that its client is still there


class EngineLoop:
    """Runs `engine.step()` in one background thread while requests are waiting or running.

    The engine ends a failing request itself (finish reason "error"). If a step raises all the same
    (a fault outside what the engine contains), the loop stops, every request in flight gets the
    error and later submits are refused (`error` holds it; /health then reports 503)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.error: Exception | None = None
        self._cond = threading.Condition()
        self._stop = False
        self._failers: dict[str, Callable[[Exception], None]] = {}
        self._thread = threading.Thread(target=self._run, name="specdec-engine", daemon=True)
        # `serve` steps on the main thread instead (`run_here`): OpenMP's thread team of a thread other
        # than the first one wakes slower, and a compiled step of the 1.5B took 65 ms there against 39 ms
        self.foreground = False

    def start(self) -> None:
        if not self.foreground:
            self._thread.start()

    def run_here(self) -> None:
        """Step the engine on the calling thread until `stop` (the foreground mode of `serve`)."""
        self._run()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join()

    def submit(self, prompt_ids: list[int], params: SamplingParams, on_tokens, request_id: str,
               on_error: Callable[[Exception], None]):
        """Queue a request (the engine checks it first and raises ContextLengthError / ValueError)."""
        with self._cond:  # under the lock: a step failing now either sees this request's failer or is seen here
            if self.error is not None:
                raise APIError(503, f"the engine stopped after an error ({self.error}); restart the server",
                               type="server_error", code="engine_failed")
            self._failers[request_id] = on_error
        try:
            req = self.engine.submit(torch.tensor(prompt_ids, dtype=torch.long), params, on_tokens=on_tokens,
                                     request_id=request_id)
        except BaseException:
            self.done(request_id)
            raise
        with self._cond:
            self._cond.notify()
        return req

    def done(self, request_id: str) -> None:
        with self._cond:
            self._failers.pop(request_id, None)

    def cancel(self, request_id: str, reason: str = "cancelled") -> bool:
        cancelled = self.engine.cancel(request_id, reason)
        self.done(request_id)
        return cancelled

    def _busy(self) -> bool:
        return self.engine.waiting + self.engine.running > 0

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stop and not self._busy():
                    self._cond.wait()
                if self._stop:
                    return
            try:
                self.engine.step()
            except Exception as err:  # the thread's boundary: fail the requests in flight, keep the server up
                log.exception("engine step failed")
                with self._cond:
                    self.error = err
                    failers, self._failers = list(self._failers.values()), {}
                for fail in failers:
                    fail(err)
                return


@dataclass
class _Progress:
    """Per-request timing, written on the engine thread."""

    arrival: float
    first: float | None = None
    last: float | None = None
    count: int = 0

    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.arrival

    def tpot(self) -> float | None:
        return None if self.count < 2 else (self.last - self.first) / (self.count - 1)


class _Choices:
    """The choices of one request as their tokens arrive: text (cut at a stop string), finish
    reason, token count. A choice whose text reaches a stop string is retired in the engine
    with reason "stop" (`finish(id)`); `close` cancels the unfinished ones (`cancel(ids)`)."""

    def __init__(self, req: GenerationRequest, cids: list[str], tokenizer, incremental: bool,
                 finish: Callable[[str], object], cancel: Callable[[list[str]], None]) -> None:
        self.cids, self.incremental = cids, incremental or bool(req.stop)
        self.finish, self.cancel = finish, cancel
        self.texts = [IncrementalText(tokenizer, req.stop) for _ in cids]
        self.reasons: list[str | None] = [None] * len(cids)

    def add(self, item) -> tuple[int, str, str | None] | None:
        """One queue item: (choice, text delta, finish reason or None), or None for a
        finished choice's late item. Without stop strings a whole reply decodes at the end."""
        i, new_ids, finished, reason = item
        if self.reasons[i] is not None:
            return None
        text = self.texts[i]
        if self.incremental or finished:
            delta = text.add(new_ids, finished)
        else:
            delta = text.extend(new_ids)
        if text.stopped:
            if not finished:
                self.finish(self.cids[i])
            finished, reason = True, "stop"
        if finished:
            self.reasons[i] = reason
        return i, delta, self.reasons[i]

    @property
    def done(self) -> bool:
        return all(r is not None for r in self.reasons)

    @property
    def tokens(self) -> int:
        """Completion tokens of every choice (a stopped one's up to the token that completed its stop string)."""
        return sum(t.tokens for t in self.texts)

    def response_choices(self) -> list[tuple[str, str]]:
        """(text, finish reason) of every finished choice."""
        return [(t.text, r) for t, r in zip(self.texts, self.reasons)]

    def close(self) -> None:
        """Cancel the choices still running (the client went away, or the reply failed)."""
        self.cancel([cid for cid, r in zip(self.cids, self.reasons) if r is None])


def _failed(item: Exception) -> APIError:
    """The error of every request in flight when the engine's loop stopped."""
    return APIError(500, f"generation failed: {item}", type="server_error", code="engine_failed")


def _request_failed(why: str) -> APIError:
    """The error of one request that failed (the others go on)."""
    return APIError(500, f"generation failed: {why}", type="server_error", code="request_failed")


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


def _error_response(err: APIError, metrics: ServerMetrics | None = None) -> JSONResponse:
    if metrics is not None:
        metrics.count_error(err)
    return JSONResponse(err.body(), status_code=err.status)


def _take(choices: _Choices, rid: str, item) -> tuple[int, str, str | None] | None:
    """One queue item applied to `choices` (`_Choices.add`); raises the APIError of a failed
    request, also when handling its text (detokenizing, stop strings) raises."""
    if isinstance(item, APIError):
        raise item
    try:
        return choices.add(item)
    except Exception as err:  # this request's fault: it alone fails
        log.exception("request %s: handling its generated tokens failed", rid)
        raise _request_failed(f"{type(err).__name__} while decoding the text: {err}") from err


async def _json_body(request: Request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError, an integer of too many digits
        raise APIError(400, f"the request body is not valid JSON ({err}); send a JSON object", None,
                       "invalid_json") from err
    except RecursionError as err:  # arrays or objects nested deeper than the parser's stack
        raise APIError(400, "the request body is not valid JSON here: it nests arrays or objects deeper than the "
                       "parser goes; send a flat JSON object", None, "invalid_json") from err
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}", None,
                       "invalid_json")
    return body


def create_app(engine, tokenizer, model_name: str, max_model_len: int | None = None) -> FastAPI:
    """The FastAPI app serving `engine` as the model `model_name` (what requests must name).

    max_model_len: prompt + generated tokens a request may reach (default: the engine's `max_len`,
    else the target's max_position_embeddings); a chat request without max_tokens may generate
    what is left of it."""
    if max_model_len is None:
        max_model_len = getattr(engine, "max_len", None) or engine.target.config.max_position_embeddings
    loop_runner = EngineLoop(engine)
    metrics = ServerMetrics(engine)
    vocab_size = engine.target.config.vocab_size
    # whether a greedy answer is independent of the batch it shares (GET /health, /v1/models)
    row_invariant = bool(getattr(engine.target, "row_invariant", False))
    started = now()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loop_runner.start()
        try:
            yield
        finally:
            loop_runner.stop()

    app = FastAPI(title="specdec serve", lifespan=lifespan)
    app.state.engine_loop, app.state.metrics = loop_runner, metrics

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError) -> JSONResponse:
        return _error_response(err, metrics)

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, err: ClientDisconnect) -> Response:
        log.info("%s %s: the client disconnected before its request arrived whole; nothing was queued",
                 request.method, request.url.path)
        return Response(status_code=499)  # nobody reads it

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {err.detail}; see GET /v1/models, POST /v1/completions, " \
                  "POST /v1/chat/completions, GET /health, GET /metrics"
        return _error_response(APIError(err.status_code, message, code=str(err.status_code)), metrics)

    def submit(req: GenerationRequest, rid: str, queue: asyncio.Queue, loop: asyncio.AbstractEventLoop) -> list[str]:
        """Queue the request's n choices (one engine request each); their engine request ids.
        Each step's tokens of choice i reach `queue` as (i, new_ids, finished, finish_reason)."""
        n = len(req.prompt_ids)
        if n >= max_model_len:
            raise APIError(400, f"the prompt has {n} tokens; this model's context is {max_model_len} tokens "
                           "(prompt + answer): shorten the prompt", "messages" if req.chat else "prompt",
                           "context_length_exceeded")
        if req.max_tokens is not None and n + req.max_tokens > max_model_len:
            raise APIError(400, f"the prompt has {n} tokens and max_tokens asks for {req.max_tokens} more; this "
                           f"model's context is {max_model_len} tokens: ask for at most {max_model_len - n}",
                           "max_tokens", "context_length_exceeded")
        max_tokens = req.max_tokens if req.max_tokens is not None else max_model_len - n

        def post(item) -> None:  # on the engine thread; it must not raise there
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the event loop has closed: the server is shutting down, nobody listens
                return

        def listener(index: int, cid: str):
            progress = _Progress(arrival=time.perf_counter())

            def on_tokens(request, new_ids: list[int]) -> None:  # on the engine thread
                t = time.perf_counter()
                if new_ids:
                    metrics.generated_tokens.inc(len(new_ids))
                    progress.first = t if progress.first is None else progress.first
                    progress.last, progress.count = t, progress.count + len(new_ids)
                reason = request.finish_reason
                if request.finished:
                    loop_runner.done(cid)
                    if reason in ("stop", "length"):
                        metrics.finished(progress.ttft(), progress.tpot())
                post(_request_failed(str(request.error)) if reason == "error" else
                     (index, list(new_ids), request.finished, reason))

            return on_tokens

        cids = [rid] if req.n == 1 else [f"{rid}-{i}" for i in range(req.n)]
        for i, cid in enumerate(cids):
            seed = None if req.seed is None else (req.seed + i) % 2 ** 63
            params = SamplingParams(max_new_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                                    top_k=req.top_k, seed=seed)
            try:
                loop_runner.submit(list(req.prompt_ids), params, listener(i, cid), cid,
                                   on_error=lambda err: post(_failed(err)))
            except BaseException as err:
                cancel(cids[:i])  # the choices queued before this one
                if isinstance(err, ContextLengthError):
                    raise APIError(400, str(err), "max_tokens", "context_length_exceeded") from err
                if isinstance(err, ValueError):
                    raise APIError(400, str(err), None, "invalid_value") from err
                raise
            metrics.prompt_tokens.inc(n)
        return cids

    def cancel(cids: list[str]) -> None:
        for cid in cids:
            loop_runner.cancel(cid)

    def choices_of(req: GenerationRequest, cids: list[str], incremental: bool) -> _Choices:
        return _Choices(req, cids, tokenizer, incremental, finish=lambda cid: loop_runner.cancel(cid, "stop"),
                        cancel=cancel)

    async def plain(request: Request, req: GenerationRequest, rid: str, cids: list[str],
                    queue: asyncio.Queue) -> JSONResponse:
        choices = choices_of(req, cids, incremental=False)
        try:
            polled = time.monotonic()
            while not choices.done:
                item = None
                try:
                    item = await asyncio.wait_for(queue.get(), _DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    pass
                if time.monotonic() - polled >= _DISCONNECT_POLL_S:  # also while tokens keep coming (n choices)
                    polled = time.monotonic()
                    if await request.is_disconnected():
                        log.info("request %s: the client disconnected; its rows are freed", rid)
                        return JSONResponse({}, status_code=499)
                if item is None:
                    continue
                _take(choices, rid, item)
            return JSONResponse(response(req, rid, now(), choices.response_choices(), choices.tokens))
        finally:
            choices.close()

    def streamed(req: GenerationRequest, rid: str, cids: list[str], queue: asyncio.Queue) -> StreamingResponse:
        async def events():
            created, choices = now(), choices_of(req, cids, incremental=True)
            try:
                if req.chat:
                    for i in range(req.n):
                        yield _sse(chunk(req, rid, created, None, role=True, index=i))
                while not choices.done:
                    item = await queue.get()
                    try:
                        added = _take(choices, rid, item)
                    except APIError as err:
                        metrics.count_error(err)
                        yield _sse(err.body())
                        break
                    if added is None:
                        continue
                    i, delta, reason = added
                    if delta:
                        yield _sse(chunk(req, rid, created, delta, index=i))
                    if reason is not None:
                        yield _sse(chunk(req, rid, created, None, finish_reason=reason, index=i))
                if choices.done and req.include_usage:
                    yield _sse(usage_chunk(req, rid, created, choices.tokens))
                yield _sse("[DONE]")
            except (asyncio.CancelledError, GeneratorExit):
                log.info("request %s: the client disconnected mid-stream; its rows are freed", rid)
                raise
            finally:
                choices.close()

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def generate(request: Request, req: GenerationRequest):
        loop, queue, rid = asyncio.get_running_loop(), asyncio.Queue(), new_id(req.chat)
        cids = submit(req, rid, queue, loop)
        if req.stream:
            return streamed(req, rid, cids, queue)
        return await plain(request, req, rid, cids, queue)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, parse_completion(await _json_body(request), model_name, tokenizer,
                                                        vocab_size))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, parse_chat(await _json_body(request), model_name, tokenizer))

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": started,
                                            "owned_by": "specdec", "max_model_len": max_model_len,
                                            "row_invariant": row_invariant}]}

    @app.get("/health")
    async def health():
        if loop_runner.error is not None:
            return JSONResponse({"status": "error", "error": str(loop_runner.error)}, status_code=503)
        return {"status": "ok", "waiting": engine.waiting, "running": engine.running, "row_invariant": row_invariant}

    @app.get("/metrics")
    async def prometheus():
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    return app


class ServerThread:
    """Run an app with uvicorn in a background thread on `host`:`port` (0 = a free port).

    `with ServerThread(app) as server: server.url` ... the server stops when the block ends."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning") -> None:
        self.host = host
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                                    lifespan="on", timeout_graceful_shutdown=5))
        self._thread = threading.Thread(target=self._run, name="specdec-http", daemon=True)
        self.port = port
        self._exit_code: int | str | None = None

    def _run(self) -> None:
        try:
            self.server.run()
        except SystemExit as err:  # uvicorn exits when startup fails (e.g. a taken port); start() reports it
            self._exit_code = err.code

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> "ServerThread":
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()  # a server still starting must not outlive the error
                why = f"uvicorn exited with status {self._exit_code}" if self._exit_code is not None \
                    else f"not within {timeout_s} s"
                raise RuntimeError(f"the HTTP server did not start on {self.host}:{self.port} ({why}); see uvicorn's "
                                   "log above (a taken port or an address this machine does not have)")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _interrupt(signum: int, frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Run the app until interrupted: HTTP in a background thread, the engine's steps on this (the
    main) thread, where its OpenMP kernels run fastest. SIGINT (Ctrl-C) and SIGTERM stop it cleanly,
    as they stop uvicorn, even when it was started with SIGINT ignored (a background job of a
    script, `nohup`: Python then installs no Ctrl-C handler of its own)."""
    engine_loop: EngineLoop = app.state.engine_loop
    engine_loop.foreground = True
    server = ServerThread(app, host=host, port=port, log_level=log_level)
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.start()
        engine_loop.run_here()  # returns at shutdown, or after a failed step: HTTP then answers 503 until Ctrl-C
        while server._thread.is_alive():
            server._thread.join(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        server.stop()  # its lifespan's shutdown stops the engine loop too


def serve_while(app: FastAPI, work: Callable[[int], T], host: str = "127.0.0.1", port: int = 0) -> T:
    """Serve the app on `host`:`port` (0 = a free port) while `work(port)` runs in a background thread,
    with the engine's steps on this thread as in `serve` (a benchmark's clients against the server as
    `specdec serve` runs it); returns what `work` returns, or raises what it raised, once it ends."""
    engine_loop: EngineLoop = app.state.engine_loop
    engine_loop.foreground = True
    outcome: dict[str, object] = {}
    with ServerThread(app, host=host, port=port) as server:

        def run() -> None:
            try:
                outcome["value"] = work(server.port)
            except BaseException as err:  # noqa: BLE001 - handed to the caller's thread below
                outcome["error"] = err
            finally:
                engine_loop.stop()

        worker = threading.Thread(target=run, name="specdec-work", daemon=True)
        worker.start()
        engine_loop.run_here()  # returns when `work` ends, or after a failed step (then HTTP answers 503)
        worker.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
