"""Per-linear output error of INT4 formats under calibration and held-out Hessians (CPU).

For each nn.Linear of the chosen layers, with the dense model's activations as inputs:

    error = tr(dW H dW^T) / tr(W H W^T),   dW = dequantized(W) - W

under H from the calibration windows (what GPTQ minimises) and under H from held-out ShareGPT
windows (what generalises). The held-out windows are numbers 32 .. 32 + N_HELDOUT of the
held-out slice, disjoint from the 32 windows that recipes/quant_benchmark.py scores perplexity
on. A format that wins here but loses in perplexity points at something the per-layer objective
misses.

    python benchmarks/quant_layer_error.py --layers 1,5,12,22 --n-calib 64 \
        --methods rtn,nf4,gptq-act,gptq-act-hmse-d0.1
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch
from torch import nn

import quant
import runtime
from quant.gptq import solve
from quant.grids import int4_rtn
from quant.layerwise import collect_stats  # the hooks GPTQ itself uses
from runtime.qlinear import NF4Linear

N_HELDOUT = 16
EVAL_OFFSET = 32  # quant_benchmark.py scores windows 0 .. 31

Method = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


def _gptq(grid: str, damp: float, act_order: bool = True) -> Method:
    return lambda W, H, g: solve(W, H, group_size=g, act_order=act_order, grid=grid, damp=damp).weight


METHODS: dict[str, Method] = {  # (W (N, K) float32, calibration H (K, K), group size) -> dequantized W
    "rtn": lambda W, H, g: int4_rtn(W, g, grid="mse").dequantize(torch.float32),
    "rtn-minmax": lambda W, H, g: int4_rtn(W, g, grid="minmax").dequantize(torch.float32),
    "nf4": lambda W, H, g: NF4Linear.quantize(W.to(torch.bfloat16), None, g, False).dequantize(torch.float32),
    "gptq": _gptq("minmax", 0.01, act_order=False),
    "gptq-act": _gptq("mse", 0.01),
    "gptq-act-hmse": _gptq("hmse", 0.01),
    "gptq-act-hmse-d0.1": _gptq("hmse", 0.1),
    "gptq-act-hmse-d0.3": _gptq("hmse", 0.3),
}


@torch.no_grad()
def hessians(model: runtime.Transformer, mods: dict[str, nn.Linear], windows: torch.Tensor,
             batch: int = 4) -> dict[str, torch.Tensor]:
    """H = 2 X X^T / n of every module's input over the (N, T) windows, one full forward per batch."""
    def run() -> None:
        for i in range(0, windows.shape[0], batch):
            w = windows[i:i + batch].to(model.device)  # (b, T)
            model(w, torch.arange(w.shape[1], device=model.device).expand_as(w), None)

    return {n: acc.H for n, acc in collect_stats(mods, "hessian", run).items()}


def relative_error(W: torch.Tensor, Q: torch.Tensor, H: torch.Tensor) -> float:
    dW = Q - W  # (N, K)
    return float(torch.einsum("nk,kl,nl->", dW, H, dW) / torch.einsum("nk,kl,nl->", W, H, W))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--layers", default="1,5,12,22", help="comma-separated block indices")
    ap.add_argument("--methods", default="rtn,nf4,gptq-act,gptq-act-hmse-d0.1",
                    help=f"comma-separated, from: {', '.join(METHODS)}")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--n-calib", type=int, default=64, help="calibration windows (sharegpt+code)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        ap.error(f"unknown method(s) {unknown}; choose from {list(METHODS)}")
    torch.set_num_threads(args.threads)

    model = runtime.load_model(args.model, dtype=torch.bfloat16, weights="dense")
    tok = runtime.load_tokenizer(args.model)
    layers = [int(x) for x in args.layers.split(",")]
    bad = [i for i in layers if not 0 <= i < model.config.num_layers]
    if bad:
        ap.error(f"--layers {bad} out of range: {args.model} has {model.config.num_layers} blocks")
    mods = {n: m for n, m in model.named_modules()
            if type(m) is nn.Linear and any(n.startswith(f"layers.{i}.") for i in layers)}
    calib = quant.calibration_batches(tok, "sharegpt+code", n_samples=args.n_calib, seq_len=args.seq_len)
    heldout = quant.eval_batches(tok, "sharegpt", n_samples=EVAL_OFFSET + N_HELDOUT,
                                 seq_len=args.seq_len)[EVAL_OFFSET:]
    t0 = time.perf_counter()
    H_cal, H_ev = hessians(model, mods, calib), hessians(model, mods, heldout)
    print(f"Hessians of {len(mods)} linears in {time.perf_counter() - t0:.0f} s; "
          f"cells: error x1e3 under calibration / held-out H", flush=True)
    print("| module | " + " | ".join(methods) + " |")
    print("|---|" + "---:|" * len(methods))
    totals = {m: [0.0, 0.0] for m in methods}
    for name, mod in mods.items():
        W = mod.weight.detach().to(torch.float32)
        cells = []
        for m in methods:
            Q = METHODS[m](W, H_cal[name], args.group_size)
            cal, ev = relative_error(W, Q, H_cal[name]), relative_error(W, Q, H_ev[name])
            totals[m][0] += cal
            totals[m][1] += ev
            cells.append(f"{cal * 1e3:.2f} / {ev * 1e3:.2f}")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    print("| **sum** | " + " | ".join(f"**{c * 1e3:.1f} / {e * 1e3:.1f}**" for c, e in totals.values()) + " |")


if __name__ == "__main__":
    main()
