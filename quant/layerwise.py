"""Layer-by-layer calibration: run the blocks in order on calibration windows, collect per-linear input
statistics with forward hooks, compress the layer, and feed its (compressed) outputs to the next.

Memory stays near one layer's activations (N, T, C) plus one statistic per linear. A block
runs without a cache, causally over its window: `Transformer.run_block(i, x, positions)`.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from quant.gptq import HessianAccumulator
from runtime.model import Transformer
from runtime.progress import progress as progress_bar

Compress = Callable[[str, nn.Linear, object], nn.Module]


class NormAccumulator:
    """Running sum of squares per input column (Wanda's ||X_j||_2 squared)."""

    def __init__(self, in_features: int, device: torch.device) -> None:
        self.sq = torch.zeros(in_features, dtype=torch.float32, device=device)

    def add(self, x: torch.Tensor) -> None:
        self.sq += x.reshape(-1, x.shape[-1]).to(torch.float32).pow(2).sum(0)

    @property
    def norms(self) -> torch.Tensor:
        return self.sq.sqrt()


def collect_stats(modules: dict[str, nn.Linear], kind: str, run: Callable[[], None]) -> dict[str, object]:
    """Run `run()` with hooks that accumulate `kind` ("hessian" | "norms") for every module's input."""
    stats: dict[str, object] = {}
    hooks = []
    for name, mod in modules.items():
        acc = (HessianAccumulator if kind == "hessian" else NormAccumulator)(mod.in_features, mod.weight.device)
        stats[name] = acc
        hooks.append(mod.register_forward_hook(lambda _m, args, _out, acc=acc: acc.add(args[0])))
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return stats


@torch.no_grad()
def compress_layerwise(model: Transformer, batches: torch.Tensor, targets: dict[str, nn.Linear], kind: str,
                       compress: Compress, desc: str, chunk: int = 8, progress: bool = True) -> None:
    """Replace every module in `targets` (name -> nn.Linear) by `compress(name, module, stats)`.

    batches: LongTensor (N, T) calibration windows. kind: "hessian" (GPTQ / SparseGPT) or
    "norms" (Wanda). Layer i is calibrated on the outputs of the already-compressed layers < i.
    """
    if batches.dim() != 2 or batches.dtype != torch.long:
        raise ValueError(f"calibration must be a LongTensor (N, T) of token windows, got "
                         f"{batches.dtype} {tuple(batches.shape)}")
    device = model.device
    N, T = batches.shape
    positions = torch.arange(T, device=device).expand(min(chunk, N), T)  # (n, T)
    xs = [model.embed(batches[i:i + chunk].to(device)) for i in range(0, N, chunk)]  # each (n, T, C)

    def forward(i: int, update: bool) -> None:
        for j, x in enumerate(xs):
            out = model.run_block(i, x, positions[:x.shape[0]])  # (n, T, C)
            if update:
                xs[j] = out

    for i in progress_bar(range(len(model.layers)), desc=desc, unit="layer", disable=not progress):
        mine = {n: m for n, m in targets.items() if n.startswith(f"layers.{i}.")}
        if mine:
            stats = collect_stats(mine, kind, lambda: forward(i, update=False))
            for name, mod in mine.items():
                model.set_submodule(name, compress(name, mod, stats[name]))
        forward(i, update=True)
    if "lm_head" in targets:
        head = targets["lm_head"]
        acc = (HessianAccumulator if kind == "hessian" else NormAccumulator)(head.in_features, device)
        for x in xs:  # the head's input; running the head itself would materialise (n, T, V) logits
            acc.add(model.norm(x))
        model.set_submodule("lm_head", compress("lm_head", head, acc))
