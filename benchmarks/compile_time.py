"""How long a fresh machine waits for compiled steps, and what the steps then cost.

Builds the compiled steps of `--tokens` sizes (1 = a plain decode step; larger sizes run with a
causal block mask, the shape of a tree verification) in a child process whose Inductor cache is
an empty temporary directory, so every build is timed from scratch, once per `--wrapper` choice
(Inductor calling the kernels from generated C++ or Python); then times every step (median of
`--reps` calls over a `--context`-token cache):

    python benchmarks/compile_time.py --model qwen2.5-coder-1.5b-instruct --weights gguf --tokens 2,4,8
    python benchmarks/compile_time.py --model smollm2-135m-instruct --tokens 1,8,48 --wrapper on,off

Prints, per wrapper and size, the build seconds (the first call), the programs built so far and
the step milliseconds, with the CPU model and flags (`runtime.hardware`) to write next to them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from runtime.hardware import cpu_summary
from runtime.loading import load_model


@torch.inference_mode()
def measure(model: str, weights: str, cpp_wrapper: bool, sizes: list[int], context: int, reps: int) -> list[dict]:
    """Build and time the compiled steps of `sizes` tokens in this process."""
    m = load_model(model, dtype=torch.bfloat16, weights=weights).compile_decode(cpp_wrapper=cpp_wrapper)
    cache = m.new_cache(1, context + max(sizes) + 1)
    gen = torch.Generator().manual_seed(0)
    vocab = m.config.vocab_size
    m(torch.randint(0, vocab, (1, context), generator=gen), torch.arange(context)[None], cache)
    rows = []
    for T in sizes:
        block = torch.ones(1, T, T, dtype=torch.bool).tril() if T > 1 else None
        tokens = torch.randint(0, vocab, (1, T), generator=gen)  # (1, T)
        positions = context + torch.arange(T)[None]  # (1, T)
        times = []
        for _ in range(reps + 1):
            cache.lengths.fill_(context)
            t0 = time.perf_counter()
            m(tokens, positions, cache, block_mask=block)
            times.append(time.perf_counter() - t0)
        rows.append({"cpp_wrapper": cpp_wrapper, "tokens": T, "build_s": times[0],
                     "programs": m.compiled_step.regions.programs, "step_ms": 1000 * statistics.median(times[1:])})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="catalogue name or checkpoint")
    p.add_argument("--weights", default="auto", help="load_model's weights= (auto, gguf, dense)")
    p.add_argument("--tokens", default="1,8,48", help="comma-separated step sizes (tokens per forward)")
    p.add_argument("--wrapper", default="on", help="comma-separated cpp_wrapper choices: on, off")
    p.add_argument("--context", type=int, default=256, help="cached tokens each step attends to")
    p.add_argument("--reps", type=int, default=20, help="timed calls per size")
    p.add_argument("--only", choices=("on", "off"), default=None, help=argparse.SUPPRESS)  # one child process
    args = p.parse_args()
    sizes = [int(s) for s in args.tokens.split(",")]
    if args.only is not None:
        print(json.dumps(measure(args.model, args.weights, args.only == "on", sizes, args.context, args.reps)))
        return
    rows = []
    for flag in args.wrapper.split(","):  # a fresh process and cache each: a build must not reuse another's
        with tempfile.TemporaryDirectory(prefix="inductor-") as cache_dir:
            out = subprocess.run([sys.executable, __file__, "--model", args.model, "--weights", args.weights,
                                  "--tokens", args.tokens, "--context", str(args.context), "--reps", str(args.reps),
                                  "--only", flag], check=True, capture_output=True, text=True,
                                 env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir}).stdout
        rows += json.loads(out.strip().splitlines()[-1])
    cpu = cpu_summary()
    print(f"{args.model}, weights {args.weights}, bf16, {torch.get_num_threads()} threads; CPU {cpu['model']}, "
          f"flags {' '.join(cpu['flags'])}")
    print("| cpp_wrapper | tokens | build (s) | programs | step (ms) |\n|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['cpp_wrapper']} | {r['tokens']} | {r['build_s']:.1f} | {r['programs']} | {r['step_ms']:.2f} |")


if __name__ == "__main__":
    main()
