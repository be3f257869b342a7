"""Would a compiled prefill cut time to first token? A prompt chunk through a compiled program
against the eager forward that prefills it today.

Prompts of more than 8 tokens are prefilled eagerly (`runtime.compile`). This times one
--chunk-token causal forward of a random prompt on an empty cache, both ways, alternating, in one
process: the eager `forward` with the last position's logits (what prefill runs), and the
model's `static_step` compiled for that chunk size (`runtime.compile.compile_step`, the program a
compiled prefill would run per chunk; it scores every position, so a variant scoring the last
one only would save at most the `--chunk - 1` extra LM-head rows, also reported). Prints medians
and the arithmetic rate of the eager forward (2 x layer weights x tokens per second), the figure
to hold against the CPU's dense GEMM peak:

    python benchmarks/compiled_prefill.py --model qwen2.5-coder-1.5b-instruct --chunk 128

Write the CPU model and flags (`runtime.hardware`) next to the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from runtime.atomic import atomic_write_text
from runtime.compile import compile_step
from runtime.hardware import cpu_summary
from runtime.loading import load_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@torch.inference_mode()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="catalogue name or checkpoint")
    p.add_argument("--chunk", type=int, default=128, help="prompt tokens per forward")
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None, help="also write the figures to this file")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model, dtype=DTYPES[args.dtype], weights="dense")
    program = compile_step(model.static_step, model.device)
    C = args.chunk
    tokens = torch.randint(0, model.config.vocab_size, (1, C), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(C)[None]

    def eager() -> torch.Tensor:
        return model(tokens, positions, model.new_cache(1, C), logits_idx=torch.tensor([[C - 1]])).logits[:, -1]

    def compiled() -> torch.Tensor:
        cache = model.new_cache(1, C)
        return program(tokens, positions, cache.k, cache.v, cache.lengths).logits[:, -1]

    start = time.perf_counter()
    same = bool(torch.equal(eager().argmax(-1), compiled().argmax(-1)))
    compile_s = time.perf_counter() - start
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    for _ in range(args.rounds):
        for name, fn in (("eager", eager), ("compiled", compiled)):
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    head = model.lm_head
    h = torch.randn(1, C - 1, model.config.hidden_size, dtype=model.dtype)
    head(h)
    t = time.perf_counter()
    head(h)
    head_s = time.perf_counter() - t
    # the layers' weights do 2 FLOPs each per token; the embedding is a lookup, the head scores one row
    skip = {id(model.embed.weight), id(getattr(head, "weight", None))}
    params = sum(w.numel() for w in model.parameters() if id(w) not in skip)
    row = {"model": args.model, "dtype": args.dtype, "chunk": C, "threads": args.threads,
           "eager_ms": statistics.median(times["eager"]) * 1e3,
           "compiled_ms": statistics.median(times["compiled"]) * 1e3,
           "extra_head_rows_ms": head_s * 1e3, "compile_s": compile_s, "same_argmax": same,
           "eager_gflops": 2 * params * C / statistics.median(times["eager"]) / 1e9, "cpu": cpu_summary()}
    print(f"{args.model} {args.dtype}, {C}-token prompt: eager {row['eager_ms']:.0f} ms, compiled "
          f"{row['compiled_ms']:.0f} ms (of which ~{row['extra_head_rows_ms']:.0f} ms scoring {C - 1} extra "
          f"positions); eager runs at {row['eager_gflops']:.0f} GFLOP/s; same argmax: {same}", flush=True)
    if args.json:
        atomic_write_text(args.json, json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
