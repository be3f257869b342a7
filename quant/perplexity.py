"""perplexity(model, batches): exp of the token-weighted mean next-token NLL over (B, T) windows."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from runtime.progress import progress as progress_bar


@torch.no_grad()
def perplexity(model: nn.Module, batches: torch.Tensor, batch_size: int = 1, progress: bool = True) -> float:
    """Perplexity of `model` on LongTensor (B, T) windows, each scored on its own (no cache).

    Every window predicts its tokens 1..T-1 from the ones before; the NLL is summed over all
    predicted tokens of all windows and divided by their count (token-weighted mean).
    progress: a bar over the batches (`runtime.progress`; off with progress=False).
    """
    if batches.dim() != 2 or batches.dtype != torch.long or batches.shape[1] < 2:
        raise ValueError(f"batches must be a LongTensor (B, T) with T >= 2, got {batches.dtype} "
                         f"{tuple(batches.shape)}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    device = model.device
    B, T = batches.shape
    total, count = 0.0, 0
    for i in progress_bar(range(0, B, batch_size), desc="perplexity", unit="batch", disable=not progress):
        tokens = batches[i:i + batch_size].to(device)  # (b, T)
        positions = torch.arange(T, device=device).expand(tokens.shape[0], T)
        logits = model(tokens, positions, None).logits  # (b, T, V)
        nll = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1),
                              reduction="sum")
        total += float(nll)
        count += tokens[:, 1:].numel()
    return math.exp(total / count)
