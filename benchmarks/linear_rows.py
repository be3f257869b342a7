"""Time bf16 `F.linear` on a model's weight shapes for 1, 2, 4, ... rows of activations.

A decoding step multiplies every weight by the step's rows: one for plain decoding, 1 + the tree's
nodes for a Medusa step. On a CPU the cost of a step against its row count is what decides which
tree pays (specdec.tree_cost), and this isolates the matrix products from the rest of the step:

    python benchmarks/linear_rows.py --model qwen2.5-coder-1.5b-instruct --rows 1,2,4,7,8,16

It prints one line per shape and row count (milliseconds, the weight bytes read per millisecond)
and, with --json PATH, writes them. Random weights of the model's shapes: no checkpoint needed.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from distill.command import parse_sizes
from runtime.loading import read_hf_config, resolve


def shapes(model: str) -> dict[str, tuple[int, int]]:
    """(out, in) of the MLP products and the LM head of `model` (catalogue name or checkpoint)."""
    cfg = read_hf_config(resolve(model))
    return {"mlp up/gate": (cfg.intermediate_size, cfg.hidden_size),
            "mlp down": (cfg.hidden_size, cfg.intermediate_size),
            "lm head": (cfg.vocab_size, cfg.hidden_size)}


def time_linear(weight: torch.Tensor, rows: int, repeats: int, generator: torch.Generator) -> float:
    """Seconds per F.linear of a (rows, in) activation by `weight`: the fastest of `repeats` after
    a warm-up of 3."""
    x = torch.randn(rows, weight.shape[1], generator=generator).to(weight.dtype)
    for _ in range(3):
        F.linear(x, weight)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        F.linear(x, weight)
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="catalogue name (its config only)")
    p.add_argument("--rows", type=parse_sizes, default="1,2,4,7,8,16", help="activation row counts")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None, help="also write the figures to this file")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    out = []
    for name, (o, i) in shapes(args.model).items():
        w = (torch.randn(o, i, generator=g) * 0.02).to(torch.bfloat16)
        for rows in args.rows:
            s = time_linear(w, rows, args.repeats, g)
            gbs = w.numel() * w.element_size() / s / 1e9
            out.append({"shape": name, "out": o, "in": i, "rows": rows, "ms": s * 1e3, "weight_gb_per_s": gbs})
            print(f"{name:12s} ({o}, {i}) rows {rows:3d}: {s * 1e3:7.2f} ms  {gbs:5.1f} GB/s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "threads": args.threads, "results": out}, f, indent=1)


if __name__ == "__main__":
    main()
