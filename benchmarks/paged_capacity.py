"""More short requests at once in the same KV memory: per-row slots against a paged pool.

One compiled target, one engine each, the same KV memory (--kv-tokens positions): (a) per-row slots,
--kv-tokens / --max-len rows of --max-len positions (`--kv-cache-tokens 0`); (b) a paged cache of
--kv-tokens positions (`--kv-cache-tokens`) with --paged-rows rows. N short chat requests (HumanEval
and ShareGPT held-out, alternating, all submitted at once) are served to the end; every answer is
checked against the other engine's:

    python benchmarks/paged_capacity.py --kv-tokens 4096 --max-len 1024 --paged-rows 16 \\
        --requests 32 --max-tokens 64 --out runs/paged_capacity

Reports per engine: rows, peak requests running at once, generated tokens / s (first submit to
last answer; the median of --rounds runs, the engines alternating), KV bytes allocated, peak KV
blocks in use, preemptions; CPU model and flags (`runtime.hardware`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from serve_load import load_prompts

import runtime
from runtime.atomic import atomic_write_text
from runtime.hardware import cpu_summary
from specdec.evaluation.evaluate import eos_ids
from specdec.serving.engine import Engine, SamplingParams


def serve(engine: Engine, prompts: list[list[int]], max_tokens: int) -> dict:
    """Submit every prompt at once, step to the end; figures and the answers."""
    t0 = time.perf_counter()
    reqs = [engine.submit(p, SamplingParams(max_new_tokens=max_tokens)) for p in prompts]
    peak = peak_blocks = 0
    while engine.waiting or engine.running:
        engine.step()
        peak = max(peak, engine.running)
        peak_blocks = max(peak_blocks, engine.metrics["kv_blocks_used"])
    elapsed = time.perf_counter() - t0
    cache = engine.loop.cache
    tokens = sum(len(r.tokens) for r in reqs)
    return {"rows": engine.max_batch, "peak_running": peak, "generated_tokens": tokens, "seconds": elapsed,
            "tokens_per_s": tokens / elapsed, "kv_bytes": 2 * cache.k.numel() * cache.k.element_size(),
            "peak_kv_blocks_used": peak_blocks, "preemptions": engine.metrics["preemptions"],
            "answers": [r.tokens for r in reqs]}


def run(args: argparse.Namespace) -> dict:
    target = runtime.load_model(args.model, dtype=torch.bfloat16, weights=args.weights, compile=True)
    tok = runtime.load_tokenizer(args.model)
    prompts = load_prompts(tok, args.requests, args.max_len - args.max_tokens - 16)
    eos = eos_ids(args.model, tok) or None
    engines = {
        "slots": Engine(target, None, max_batch=args.kv_tokens // args.max_len, max_len=args.max_len,
                        eos_token_id=eos, prefix_cache_tokens=0, kv_cache_tokens=0),
        "paged": Engine(target, None, max_batch=args.paged_rows, max_len=args.max_len, eos_token_id=eos,
                        prefix_cache_tokens=0, kv_cache_tokens=args.kv_tokens),
    }
    for name, engine in engines.items():  # compile the decode step of each batch size outside the timing
        print(f"{name}: warming up ({engine.max_batch} rows)", flush=True)
        serve(engine, prompts[:1], 4)
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    for r in range(args.rounds):  # slots, paged, then paged, slots, ...: a drift of the machine hits both
        for name in (list(engines) if r % 2 == 0 else list(reversed(engines))):
            print(f"round {r + 1}, {name}: serving {len(prompts)} requests", flush=True)
            res = serve(engines[name], prompts, args.max_tokens)
            runs[name].append(res)
            print(f"round {r + 1}, {name}: {res['rows']} rows, peak {res['peak_running']} running, "
                  f"{res['tokens_per_s']:.1f} tok/s, KV {res['kv_bytes'] / 2**20:.0f} MiB", flush=True)
    answers = [res.pop("answers") for name in engines for res in runs[name]]
    same = all(a == answers[0] for a in answers)
    out = {name: {**res[0], "tokens_per_s": statistics.median(x["tokens_per_s"] for x in res),
                  "tokens_per_s_runs": [x["tokens_per_s"] for x in res],
                  "preemptions": max(x["preemptions"] for x in res)} for name, res in runs.items()}
    print(f"answers equal: {same}; throughput paged / slots (medians of {args.rounds}): "
          f"{out['paged']['tokens_per_s'] / out['slots']['tokens_per_s']:.2f}x", flush=True)
    return {"model": args.model, "weights": args.weights, "kv_tokens": args.kv_tokens, "max_len": args.max_len,
            "requests": len(prompts), "max_tokens": args.max_tokens, "rounds": args.rounds, "answers_equal": same,
            "cpu": cpu_summary(), "threads": torch.get_num_threads(), **out}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--weights", default="auto", help="as runtime.load_model (default: %(default)s)")
    p.add_argument("--kv-tokens", type=int, default=4096, help="KV positions of both engines (default: %(default)s)")
    p.add_argument("--max-len", type=int, default=1024, help="prompt + answer per request (default: %(default)s)")
    p.add_argument("--paged-rows", type=int, default=16, help="rows of the paged engine (default: %(default)s)")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2, help="alternations of the two engines (default: %(default)s)")
    p.add_argument("--out", type=Path, default=None, help="directory for result.json")
    args = p.parse_args()
    result = run(args)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.out / "result.json", json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
