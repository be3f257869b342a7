"""What Inductor's C++ wrapper (`cpp_wrapper`) buys a compiled step, and what it costs to build.

`runtime.compile.compile_step` can have Inductor call a program's kernels from generated C++
(`cpp_wrapper=True`) or from generated Python; the runtime uses C++ up to 8 tokens only
(`runtime.compile.uses_cpp_wrapper`), a rule this benchmark lifts to time both at every size. It
builds the compiled steps of `--tokens` sizes (1 = a plain decode step; larger sizes run with a
causal block mask, the shape of a tree verification) both ways, each way in its own process with
Inductor's caches off, so the build is timed from scratch; then times every step (median of
`--reps` calls over a `--context`-token cache):

    python benchmarks/compile_wrapper.py --model smollm2-135m-instruct --tokens 1,8,48
    python benchmarks/compile_wrapper.py --model qwen2.5-coder-1.5b-instruct --tokens 1,8

Prints, per wrapper and size, the build seconds (the first call) and the step milliseconds.
Write the CPU model and flags (printed, from `runtime.hardware`) next to the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

import runtime.compile
from runtime.hardware import cpu_summary
from runtime.loading import load_model


@torch.inference_mode()
def measure(model: str, cpp_wrapper: bool, sizes: list[int], context: int, reps: int) -> list[dict]:
    """Build and time the compiled steps of `sizes` tokens in this process (caches off)."""
    torch._inductor.config.force_disable_caches = True
    # time the wrapper asked for at every size: lift the runtime's rule (C++ only up to 8 tokens) in this child
    runtime.compile.uses_cpp_wrapper = lambda num_tokens, cpp_wrapper=True: cpp_wrapper
    m = load_model(model, dtype=torch.bfloat16).compile_decode(cpp_wrapper=cpp_wrapper)
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
                     "step_ms": 1000 * statistics.median(times[1:])})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="catalogue name or checkpoint")
    p.add_argument("--tokens", default="1,8,48", help="comma-separated step sizes (tokens per forward)")
    p.add_argument("--context", type=int, default=256, help="cached tokens each step attends to")
    p.add_argument("--reps", type=int, default=20, help="timed calls per size")
    p.add_argument("--only", choices=("on", "off"), default=None, help=argparse.SUPPRESS)  # one child process
    args = p.parse_args()
    sizes = [int(s) for s in args.tokens.split(",")]
    if args.only is not None:
        print(json.dumps(measure(args.model, args.only == "on", sizes, args.context, args.reps)))
        return
    rows = []
    for flag in ("on", "off"):  # a fresh process each: a build must not reuse the other's kernels
        out = subprocess.run([sys.executable, __file__, "--model", args.model, "--tokens", args.tokens,
                              "--context", str(args.context), "--reps", str(args.reps), "--only", flag],
                             check=True, capture_output=True, text=True).stdout
        rows += json.loads(out.strip().splitlines()[-1])
    cpu = cpu_summary()
    print(f"{args.model}, bf16, {torch.get_num_threads()} threads; CPU {cpu['model']}, flags "
          f"{' '.join(cpu['flags'])}")
    print("| cpp_wrapper | tokens | build (s) | step (ms) |\n|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['cpp_wrapper']} | {r['tokens']} | {r['build_s']:.1f} | {r['step_ms']:.2f} |")


if __name__ == "__main__":
    main()
