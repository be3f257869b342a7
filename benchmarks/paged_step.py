"""Decode step cost through a paged KV cache's block table against contiguous per-row slots.

The same compiled target runs the same steps (a 1-token decode step and a 4-token verification
block) at the same context length over both caches, alternating in rounds so a drift of the
machine's bandwidth hits both alike; the paged cache's blocks are handed out interleaved across rows
(as a server's pool ends up), so no row's blocks are consecutive:

    python benchmarks/paged_step.py --model qwen2.5-coder-1.5b-instruct --batches 1,4 --context 512 \\
        --out runs/paged_step

Prints and writes (JSON) the median step time of each cache and their ratio (paged / contiguous)
per batch and block size, with the CPU model and flags (`runtime.hardware`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from runtime.atomic import atomic_write_text
from runtime.hardware import cpu_summary
from runtime.loading import load_model


def filled(model, batch: int, context: int, paged: bool):
    """A cache of `batch` rows holding `context` positions of random keys and values each."""
    room = context + 64
    cache = model.new_cache(batch, room, paged_tokens=batch * room if paged else None)
    if paged:
        for n in range(1, cache.blocks_needed(room) + 1):  # interleaved: row 0's block, row 1's, ...
            for r in range(batch):
                cache.reserve(r, n * cache.block_size)
    g = torch.Generator().manual_seed(0)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g).to(cache.k.dtype))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g).to(cache.v.dtype))
    if paged:
        cache.k[:, 0] = 0  # the null block stays zero
        cache.v[:, 0] = 0
    cache.lengths.fill_(context)
    return cache


def run(args: argparse.Namespace) -> dict:
    model = load_model(args.model, dtype=torch.bfloat16, weights=args.weights).compile_decode()
    vocab = model.config.vocab_size
    rows = []
    with torch.inference_mode():
        for batch in args.batches:
            caches = {"contiguous": filled(model, batch, args.context, False),
                      "paged": filled(model, batch, args.context, True)}
            for T in args.tokens:
                tokens = torch.randint(0, vocab, (batch, T), generator=torch.Generator().manual_seed(T))
                positions = args.context + torch.arange(T)[None].expand(batch, -1)

                def step(cache) -> float:
                    t = time.perf_counter()
                    model(tokens, positions, cache)
                    elapsed = time.perf_counter() - t
                    cache.rollback(cache.lengths - T)
                    return elapsed

                for name, cache in caches.items():  # compile (first call of each shape), then warm up
                    print(f"batch {batch}, {T} tokens: compiling / warming up the {name} step", flush=True)
                    step(cache)
                    step(cache)
                times = {name: [] for name in caches}
                for _ in range(args.rounds):
                    for name, cache in caches.items():
                        times[name] += [step(cache) for _ in range(args.steps)]
                med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
                row = {"batch": batch, "tokens": T, "contiguous_ms": med["contiguous"], "paged_ms": med["paged"],
                       "ratio": med["paged"] / med["contiguous"]}
                print(f"batch {batch}, {T} tokens, context {args.context}: contiguous {row['contiguous_ms']:.2f} ms, "
                      f"paged {row['paged_ms']:.2f} ms, ratio {row['ratio']:.3f}", flush=True)
                rows.append(row)
    return {"model": args.model, "weights": args.weights, "context": args.context, "cpu": cpu_summary(),
            "threads": torch.get_num_threads(), "rows": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--weights", default="auto", help="as runtime.load_model (default: %(default)s)")
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    p.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4],
                   help="tokens per step: 1 = a decode step, more = a verification block (default: 1,4)")
    p.add_argument("--context", type=int, default=512, help="positions each row holds (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=6, help="alternations of the two caches (default: %(default)s)")
    p.add_argument("--steps", type=int, default=5, help="steps per cache and round (default: %(default)s)")
    p.add_argument("--out", type=Path, default=None, help="directory for result.json")
    args = p.parse_args()
    result = run(args)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.out / "result.json", json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
