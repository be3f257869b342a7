"""Load test of the prefix cache: `specdec serve` against llama-server on the same GGUF, 4 clients.

    python benchmarks/prefix_cache_load.py --out runs/prefix_cache_load              # 1.5B 4-bit, suffix
    python benchmarks/prefix_cache_load.py --model smollm2-135m-instruct --conversations 4 \\
        --system-requests 8 --system-tokens 300 --out runs/prefix_cache_quick       # a quick run

Two workloads, each run by `--concurrency` client threads against each server in turn:

(a) multi-turn chat: held-out ShareGPT conversations with at least `--turns` user turns; a client
    takes a conversation and sends turn after turn, each turn the whole conversation so far (chat
    template, the server's own earlier answers as assistant turns, as a chat client does), and
    waits for the streamed answer before the next turn;
(b) shared system prompt: `--system-requests` requests, each a `--system-tokens`-token system
    prompt (held-out ShareGPT text) and a different user question, `--concurrency` at a time.

Servers, each a process of its own: `specdec serve` (max batch = concurrency, the given drafter,
`--compile` with --compile, `--kv-cache-tokens` with --kv-cache-tokens: a paged cache whose pool the
prefix cache shares) with its prefix cache and, for (b), without it (`--prefix-cache-tokens
0`); llama-server on the
target's GGUF with `-np concurrency` and `cache_prompt` on (its slots keep their last prompt),
`--no-repack` on AMX CPUs. Prompts go as token ids, greedy, `--max-tokens` new tokens each.

Reported per server and workload: median and mean time to first token (request sent to first
streamed token; for (a) also over turns 3+), total throughput (generated tokens over the
workload's wall time), and specdec's prefill and prefix-cache counters (its /metrics). Writes
prefix_cache_load.json and .md to --out. llama-server is skipped (with a line) when llama.cpp is
not built (`make llamacpp`).
"""

from __future__ import annotations

import argparse
import http.client
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import runtime
from runtime.atomic import atomic_write_text
from runtime.catalogue import fetch_gguf
from runtime.hardware import cpu_summary
from specdec.evaluation import llamacpp
from specdec.evaluation.prompts import encode, sharegpt_prompts

MODEL_NAME = "load-test"


def stream(port: int, path: str, body: dict) -> tuple[float | None, float, str, int]:
    """POST a streamed request; (seconds to the first token, seconds to the end, text, new tokens)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    start, first, text, tokens = time.perf_counter(), None, "", 0
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"{path} answered HTTP {resp.status}: {resp.read()[:200]!r}")
        for line in resp:
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[len(b"data: "):]
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("error"):
                raise RuntimeError(f"stream error: {chunk['error']}")
            piece = chunk["choices"][0]["text"] if "choices" in chunk and chunk["choices"] else chunk.get("content", "")
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if "tokens" in chunk and not chunk.get("stop"):
                tokens += len(chunk["tokens"])
            if piece:
                first = first or time.perf_counter()
                text += piece
            if chunk.get("stop"):  # llama-server's last chunk
                break
    finally:
        conn.close()
    return (None if first is None else first - start), time.perf_counter() - start, text, tokens


class Client:
    """How one server is asked: its port, endpoint and request body for prompt ids."""

    def __init__(self, port: int, llama: bool, max_tokens: int) -> None:
        self.port, self.llama, self.max_tokens = port, llama, max_tokens

    def ask(self, ids: list[int]) -> tuple[float | None, float, str, int]:
        if self.llama:
            body = {"prompt": ids, "n_predict": self.max_tokens, "temperature": 0, "stream": True,
                    "cache_prompt": True, "return_tokens": True}
            return stream(self.port, "/completion", body)
        body = {"model": MODEL_NAME, "prompt": ids, "max_tokens": self.max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        return stream(self.port, "/v1/completions", body)


def timed(job, items: list, concurrency: int) -> tuple[list, float]:
    """job(item) for every item, `concurrency` at a time (as many clients); (results, wall seconds)."""
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        results = list(pool.map(job, items))
    return results, time.perf_counter() - start


def run_chat(client: Client, tok, conversations: list[tuple[str, ...]], concurrency: int) -> dict:
    """Workload (a): each client sends a conversation's turns one after the other."""
    def converse(conv: tuple[str, ...]) -> list[tuple[int, float | None, int]]:  # (turn, TTFT, new tokens)
        answers, turns = [], []
        for t in range(len(conv)):
            ttft, _, text, n = client.ask(encode(tok, list(conv[:t + 1]), answers, raw=False))
            answers.append(text)
            turns.append((t, ttft, n))
        return turns

    results, wall = timed(converse, conversations, concurrency)
    turns = [turn for conv in results for turn in conv]
    late = [x for t, x, _ in turns if t >= 2 and x is not None]
    every = [x for _, x, _ in turns if x is not None]
    tokens = sum(n for _, _, n in turns)
    return {"turns": len(turns), "ttft_p50_turn3plus_s": statistics.median(late), "ttft_mean_s": statistics.mean(every),
            "ttft_p50_s": statistics.median(every), "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall}


def run_system(client: Client, prompts: list[list[int]], concurrency: int) -> dict:
    """Workload (b): the requests, `concurrency` in flight at a time."""
    out, wall = timed(lambda ids: client.ask(ids), prompts, concurrency)
    ttfts = [x[0] for x in out if x[0] is not None]
    tokens = sum(x[3] for x in out)
    return {"requests": len(out), "ttft_mean_s": statistics.mean(ttfts), "ttft_p50_s": statistics.median(ttfts),
            "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall}


def workloads(tok, args) -> tuple[list[tuple[str, ...]], list[list[int]]]:
    """(conversations of (a), prompts of (b)), each user turn cut to --max-turn-tokens tokens."""
    def cut(text: str) -> str:
        return tok.decode(tok(text, add_special_tokens=False)["input_ids"][:args.max_turn_tokens])

    multi = [p for p in sharegpt_prompts(limit=40 * args.conversations, all_turns=True) if len(p.turns) >= args.turns]
    conversations = [tuple(cut(t) for t in p.turns[:args.turns]) for p in multi[:args.conversations]]
    texts = "\n\n".join(p.turns[0] for p in sharegpt_prompts(limit=200))
    system = tok.decode(tok(texts, add_special_tokens=False)["input_ids"][:args.system_tokens])
    questions = [cut(p.turns[0]) for p in sharegpt_prompts(limit=200 + args.system_requests)[200:]]
    texts = [tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": q}],
                                     add_generation_prompt=True, tokenize=False) for q in questions]
    return conversations, [list(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]


class SpecdecServer:
    """`specdec serve` in a process of its own (as a user runs it, and as llama-server runs), with
    max batch = concurrency; a context manager that stops it on exit."""

    def __init__(self, args, prefix_cache_tokens: int | None) -> None:
        self.port = llamacpp.free_port()
        self.cmd = [sys.executable, "-m", "specdec.cli", "serve", "--model", args.model, "--weights", args.weights,
                    "--max-batch", str(args.concurrency), "--max-len", str(args.max_len), "--port", str(self.port),
                    "--served-model-name", MODEL_NAME, "--log-level", "warning"]
        self.cmd += [] if args.draft == "none" else ["--draft", args.draft]
        self.cmd += ["--compile"] if args.compile else []
        self.cmd += [] if prefix_cache_tokens is None else ["--prefix-cache-tokens", str(prefix_cache_tokens)]
        self.cmd += [] if args.kv_cache_tokens is None else ["--kv-cache-tokens", str(args.kv_cache_tokens)]
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "SpecdecServer":
        self.log = tempfile.NamedTemporaryFile("w+", prefix="specdec-serve-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT)
        # a fresh Inductor cache compiles every block step first
        if llamacpp.wait_healthy(f"http://127.0.0.1:{self.port}", self.proc, 1800, poll_s=1.0):
            return self
        if self.proc.poll() is not None:
            sys.exit(f"specdec serve exited with code {self.proc.returncode}; its log: {self.log.name}")
        sys.exit(f"specdec serve did not become healthy in 1800 s; its log: {self.log.name}")

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)
        self.log.close()

    def counters(self) -> dict:
        """The engine's prefill and prefix-cache counters, from /metrics."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        out = {}
        for name in ("prefill_tokens_total", "prefix_cache_lookups_total", "prefix_cache_hits_total",
                     "prefix_cache_hit_tokens_total", "prefix_cache_evictions_total"):
            found = re.search(rf"^specdec_{name} ([0-9.e+]+)$", text, re.M)
            out[name.removesuffix("_total")] = int(float(found.group(1))) if found else None
        return out


def markdown(report: dict) -> str:
    rows = ["| workload | server | TTFT p50 (s) | TTFT p50 turns 3+ (s) | TTFT mean (s) | tok/s | tokens | wall (s) |",
            "|---|---|---:|---:|---:|---:|---:|---:|"]
    for workload in ("chat", "system"):
        for server, r in report[workload].items():
            late = r.get("ttft_p50_turn3plus_s", float("nan"))
            rows.append(f"| {workload} | {server} | {r['ttft_p50_s']:.2f} | {late:.2f} | {r['ttft_mean_s']:.2f}"
                        f" | {r['tokens_per_s']:.1f} | {r['tokens']} | {r['wall_s']:.0f} |")
    lines = [f"# Prefix cache load test ({report['model']}, drafter {report['draft']}, {report['concurrency']} "
             f"clients)", "", f"CPU: {report['cpu']}", "", *rows, ""]
    for name, ratio in report["ratios"].items():
        lines.append(f"- {name}: **{ratio:.2f}x**")
    for name, counters in report["counters"].items():
        lines.append(f"- {name} engine: " + ", ".join(f"{k} {v}" for k, v in counters.items()))
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--weights", default="auto")
    p.add_argument("--draft", default="suffix",
                   help="specdec's drafter spec, or none for plain decoding (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-turn-tokens", type=int, default=160)
    p.add_argument("--system-requests", type=int, default=16)
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--kv-cache-tokens", type=int, default=None,
                   help="specdec serve --kv-cache-tokens: a paged KV cache whose pool the prefix cache shares")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--compile", action="store_true", help="compile specdec's decode steps (built before timing)")
    p.add_argument("--workloads", default="chat,system", help="comma-separated: chat, system")
    p.add_argument("--skip", default="", help="comma-separated servers to leave out: llama,nocache")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tok = runtime.load_tokenizer(args.model)
    conversations, system_prompts = workloads(tok, args)
    print(f"{len(conversations)} conversations of {args.turns} turns; {len(system_prompts)} requests sharing a "
          f"{args.system_tokens}-token system prompt", flush=True)
    report = {"model": args.model, "draft": args.draft, "concurrency": args.concurrency,
              "kv_cache_tokens": args.kv_cache_tokens, "cpu": str(cpu_summary()),
              "args": vars(args), "chat": {}, "system": {}, "counters": {}}
    chat_on, system_on = (w in args.workloads.split(",") for w in ("chat", "system"))
    variants = [("specdec", None)] + ([] if "nocache" in skip else [("specdec, prefix cache off", 0)])
    for name, tokens in variants:
        print(f"{name}: starting specdec serve", flush=True)
        with SpecdecServer(args, tokens) as server:
            client = Client(server.port, False, args.max_tokens)
            for n in (16, 40):  # warm-up: the batch's 1-token step and a short prefill
                client.ask(system_prompts[0][:n])
            if tokens is None and chat_on:
                print(f"{name}: chat", flush=True)
                report["chat"][name] = run_chat(client, tok, conversations, args.concurrency)
            if system_on:
                print(f"{name}: shared system prompt", flush=True)
                report["system"][name] = run_system(client, system_prompts, args.concurrency)
            report["counters"][name] = server.counters()
    if "llama" not in skip and llamacpp.available():
        gguf = fetch_gguf(args.model, progress=False)
        server = llamacpp.LlamaServer(gguf, threads=args.threads, context=args.concurrency * args.max_len)
        server.command = _parallel(server.command, args.concurrency)
        with server:
            client = Client(server.port, True, args.max_tokens)
            client.ask(system_prompts[0][:16])
            if chat_on:
                print("llama-server: chat", flush=True)
                report["chat"]["llama-server"] = run_chat(client, tok, conversations, args.concurrency)
            if system_on:
                print("llama-server: shared system prompt", flush=True)
                report["system"]["llama-server"] = run_system(client, system_prompts, args.concurrency)
    elif "llama" not in skip:
        print("llama-server is not built (make llamacpp): its rows are left out", flush=True)
    ratios = {}
    chat, system = report["chat"], report["system"]
    if "llama-server" in chat and "specdec" in chat:
        ratios["chat TTFT p50 turns 3+, specdec / llama-server"] = (chat["specdec"]["ttft_p50_turn3plus_s"]
                                                                    / chat["llama-server"]["ttft_p50_turn3plus_s"])
        ratios["chat throughput, specdec / llama-server"] = (chat["specdec"]["tokens_per_s"]
                                                             / chat["llama-server"]["tokens_per_s"])
    if "llama-server" in system and "specdec" in system:
        ratios["system TTFT mean, specdec / llama-server"] = (system["specdec"]["ttft_mean_s"]
                                                              / system["llama-server"]["ttft_mean_s"])
    if "specdec, prefix cache off" in system:
        ratios["system TTFT mean, prefix cache on / off"] = (system["specdec"]["ttft_mean_s"]
                                                             / system["specdec, prefix cache off"]["ttft_mean_s"])
    report["ratios"] = ratios
    atomic_write_text(out / "prefix_cache_load.json", json.dumps(report, indent=2))
    atomic_write_text(out / "prefix_cache_load.md", markdown(report))
    print(markdown(report), flush=True)


def _parallel(command, slots: int):
    """llama-server's command with `slots` parallel slots instead of one."""
    def build() -> list[str]:
        cmd = command()
        cmd[cmd.index("-np") + 1] = str(slots)
        return cmd
    return build


if __name__ == "__main__":
    main()
