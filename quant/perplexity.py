"""perplexity(model, batches): exp of the token-weighted mean next-token NLL over (B, T) windows."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from runtime.args import check_bool, check_int, describe
from runtime.progress import progress as progress_bar


@torch.no_grad()
def perplexity(model: nn.Module, batches: torch.Tensor, batch_size: int = 1, progress: bool = True) -> float:
    """Perplexity of `model` on LongTensor (B, T) windows, each scored on its own (no cache).

    Every window predicts its tokens 1..T-1 from the ones before; the NLL is summed over all
    predicted tokens of all windows and divided by their count (token-weighted mean).
    progress: a bar over the batches (`runtime.progress`; off with progress=False).
    A TypeError or ValueError names the argument that is wrong: batches not a LongTensor (B, T) with
    B >= 1 and T >= 2, token ids outside the model's vocabulary, batch_size not an integer >= 1.
    """
    if not isinstance(batches, torch.Tensor):
        raise TypeError(f"batches must be a LongTensor (B, T) of token ids, got {describe(batches)}; stack the "
                        "windows with torch.tensor(...) first")
    if batches.dim() != 2 or batches.dtype != torch.long or batches.shape[1] < 2 or batches.shape[0] < 1:
        raise ValueError(f"batches must be a LongTensor (B, T) with B >= 1 and T >= 2, got {batches.dtype} "
                         f"{tuple(batches.shape)}")
    batch_size = check_int("batch_size", batch_size, minimum=1)
    check_bool("progress", progress)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    low, high = int(batches.min()), int(batches.max())
    if vocab is not None and (low < 0 or high >= vocab):
        raise ValueError(f"batches holds token ids outside the model's vocabulary [0, {vocab}): "
                         f"{low if low < 0 else high}; tokenize with the model's own tokenizer")
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
