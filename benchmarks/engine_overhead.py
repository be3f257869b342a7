"""The continuous-batching engine against generate() on the same batch: does its per-row
bookkeeping (admissions, per-row sampling, slots) cost anything per step?

    python benchmarks/engine_overhead.py --model smollm2-135m-instruct --draft ngram --threads 1

Four random prompts of the same length decode the same number of tokens greedily, once through
specdec.generate (one batch) and once through an Engine with max_batch 4 (all submitted before its
first step), alternating, after a warm-up of each; prints the wall seconds of each round and the
medians. Outputs are checked equal.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import runtime
import specdec
from runtime.hardware import DTYPES, cpu_summary
from specdec.serving.engine import Engine, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--draft", default="ngram", help="'ngram', 'none', or a draft model (default: %(default)s)")
    ap.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    ap.add_argument("--prompt-tokens", type=int, default=60)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    target = runtime.load_model(args.model, dtype=dtype, weights="dense")
    draft = {"none": None, "ngram": "ngram"}.get(args.draft)
    if args.draft not in ("none", "ngram"):
        draft = runtime.load_model(args.draft, dtype=dtype, weights="dense")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, target.config.vocab_size, (args.prompt_tokens,), generator=g) for _ in range(4)]

    def with_generate() -> tuple[float, list[list[int]]]:
        start = time.perf_counter()
        out = specdec.generate(target, prompts, draft=draft, max_new_tokens=args.new_tokens)
        return time.perf_counter() - start, [s[args.prompt_tokens:].tolist() for s in out.sequences]

    def with_engine() -> tuple[float, list[list[int]]]:
        engine = Engine(target, draft, max_batch=4, max_len=args.prompt_tokens + args.new_tokens)
        start = time.perf_counter()
        reqs = [engine.submit(p, SamplingParams(max_new_tokens=args.new_tokens)) for p in prompts]
        engine.run_until_done()
        return time.perf_counter() - start, [r.tokens for r in reqs]

    with_generate(), with_engine()  # warm-up
    times: dict[str, list[float]] = {"generate": [], "engine": []}
    for i in range(args.rounds):
        (a, out_a), (b, out_b) = with_generate(), with_engine()
        if out_a != out_b:
            raise SystemExit(f"round {i}: the engine's tokens differ from generate()'s")
        times["generate"].append(a)
        times["engine"].append(b)
        print(f"round {i}: generate {a:.3f} s, engine {b:.3f} s", flush=True)
    g_med, e_med = statistics.median(times["generate"]), statistics.median(times["engine"])
    cpu = cpu_summary()
    print(f"medians: generate {g_med:.3f} s, engine {e_med:.3f} s, engine / generate {e_med / g_med:.3f} "
          f"({args.model} {args.dtype}, draft {args.draft}, {torch.get_num_threads()} threads; {cpu['model']}, "
          f"{cpu['cores']} cores, {' '.join(cpu['flags'])})")


if __name__ == "__main__":
    main()
