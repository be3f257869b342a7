"""Time `F.linear` on a model's weight shapes for 1, 2, 4, ... rows of activations, per dtype.

A decoding step multiplies every weight by the step's rows: one for plain decoding, 1 + the tree's
nodes for a Medusa step. On a CPU the cost of a step against its row count is what decides which
tree pays (specdec.tuning.tree_cost), and this isolates the matrix products from the rest of the step:

    python benchmarks/linear_rows.py --model qwen2.5-coder-1.5b-instruct --rows 1,2,4,7,8,16

It prints one line per dtype, shape and row count (milliseconds, the weight bytes read per
millisecond) and, with --json PATH, writes them. Random weights of the model's shapes: no
checkpoint needed. `--dtypes bfloat16,float32` compares the two (on an AVX2-only CPU bf16 is
widened to float32 inside every product: `runtime.hardware`); `--kernel inductor` times the
product as `runtime.compile_decode(max_autotune=True)` compiles it (Inductor with frozen weights,
keeping the faster of its own C++ GEMM and ATen per shape; a few seconds of autotuning each).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from distill.command import parse_sizes
from runtime.atomic import atomic_write_text
from runtime.hardware import DTYPES
from runtime.loading import read_hf_config, resolve


def shapes(model: str) -> dict[str, tuple[int, int]]:
    """(out, in) of the MLP products and the LM head of `model` (catalogue name or checkpoint)."""
    cfg = read_hf_config(resolve(model))
    return {"mlp up/gate": (cfg.intermediate_size, cfg.hidden_size),
            "mlp down": (cfg.hidden_size, cfg.intermediate_size),
            "lm head": (cfg.vocab_size, cfg.hidden_size)}


class _Linear(torch.nn.Module):
    """One bias-free product with a fixed weight, for Inductor to compile with the weight frozen."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def linear_fn(weight: torch.Tensor, kernel: str):
    """x -> x @ weight.T as ATen runs it eagerly, or as Inductor compiles it (max-autotune, frozen
    weight, as `runtime.compile_decode(max_autotune=True)` does)."""
    if kernel == "aten":
        return lambda x: F.linear(x, weight)
    # every shape and row count compiles `_Linear.forward` again: past Dynamo's recompile limit
    # (8 per code object) it would silently run eagerly, so each timing starts from a clean cache
    torch._dynamo.reset()
    compiled = torch.compile(_Linear(weight).eval(), dynamic=False)

    def run(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad(), torch._inductor.config.patch(freezing=True, max_autotune=True):
            return compiled(x)
    return run


def time_linear(weight: torch.Tensor, rows: int, repeats: int, generator: torch.Generator,
                kernel: str = "aten") -> float:
    """Seconds per product of a (rows, in) activation by `weight`: the fastest of `repeats` after
    a warm-up of 3 (which compiles, for kernel "inductor")."""
    x = torch.randn(rows, weight.shape[1], generator=generator).to(weight.dtype)
    fn = linear_fn(weight, kernel)
    for _ in range(3):
        fn(x)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn(x)
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="catalogue name (its config only)")
    p.add_argument("--rows", type=parse_sizes, default="1,2,4,7,8,16", help="activation row counts")
    p.add_argument("--dtypes", default="bfloat16", help=f"comma-separated, from {', '.join(DTYPES)}")
    p.add_argument("--kernel", default="aten", choices=["aten", "inductor"],
                   help="eager ATen products, or Inductor's compiled ones (max-autotune, frozen weights)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None, help="also write the figures to this file")
    args = p.parse_args()
    unknown = [d for d in args.dtypes.split(",") if d not in DTYPES]
    if unknown:
        p.error(f"--dtypes: unknown {unknown}; choose from {', '.join(DTYPES)}")
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    out = []
    for dtype_name in args.dtypes.split(","):
        for name, (o, i) in shapes(args.model).items():
            w = (torch.randn(o, i, generator=g) * 0.02).to(DTYPES[dtype_name])
            for rows in args.rows:
                s = time_linear(w, rows, args.repeats, g, args.kernel)
                gbs = w.numel() * w.element_size() / s / 1e9
                out.append({"dtype": dtype_name, "shape": name, "out": o, "in": i, "rows": rows, "ms": s * 1e3,
                            "weight_gb_per_s": gbs})
                print(f"{dtype_name:8s} {name:12s} ({o}, {i}) rows {rows:3d}: {s * 1e3:7.2f} ms  {gbs:5.1f} GB/s",
                      flush=True)
    if args.json:
        atomic_write_text(args.json, json.dumps({"model": args.model, "threads": args.threads, "kernel": args.kernel,
                                                 "results": out}, indent=1))


if __name__ == "__main__":
    main()
