"""Row-invariant forwards: a row's logits do not depend on how many query tokens (a decode step,
a verification block, a tree), other rows or padding slots share its forward.

That is what makes speculative decoding lossless in bf16 (a token verified in a block of k + 1
gets the bits it would get decoded alone) and a server's answers independent of its batch. Two
parts of a plain bf16 forward on the CPU break it (tests/runtime/test_invariant.py shows both):

- Linears. oneDNN's bf16 matmul gives a row the same bits in every call of 2..32 rows, but a
  1-row call takes another path and calls of more rows split the reduction by the row count.
  `linear` therefore pads a 1-row call to 2 rows and splits longer ones into calls of at most 32.
  Two rows cost no more than one there, so this is free for decode steps and verification blocks.
- Attention. SDPA's reduction order depends on the query count and on other rows' padding, so
  `attention` runs `attention_rows` (runtime/kernels/cpu_attention.cpp): each query alone, over
  its visible keys in slot order, in one fixed float32 arithmetic.

The block-quantized linears (`runtime.blockq`) are row-invariant by construction, in float32 too:
a float32 model whose every linear is one (a GGUF's 4-bit model where bf16 is slow) needs only the
attention kernel, which takes float32. Prefills run
these kernels too (on this project's CPUs no slower than the batch-dependent GEMMs and SDPA), so a
token's keys and logits do not depend on how its prompt was split between forwards either: a
prefix cache (`runtime.prefix_cache`) reuses the keys of one request's prompt in another's. A
forward without a cache (scoring, training) keeps the batch-dependent kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

MIN_ROWS = 2  # a 1-row bf16 matmul takes another oneDNN path than 2..MAX_ROWS rows
MAX_ROWS = 32  # beyond this the matmul's reduction order depends on the row count


def unsupported_reason(device: torch.device, dtype: torch.dtype, dense_linears: bool = True) -> str | None:
    """Why forwards on `device` in `dtype` cannot be row-invariant here (None: they can).

    Supported: bf16 on the CPU with the C++ kernels built (`runtime.kernels.cpu_attention`), and
    float32 there when no linear is a dense `nn.Linear` (dense_linears=False: every linear is
    block-quantized, row-invariant by construction, as a GGUF's 4-bit model on an AVX2 CPU runs).
    Dense float32 is not: MKL's sgemm changes a row's bits with the row count below 16 rows, and
    padding a decode step to 16 rows costs 16x its compute."""
    if torch.device(device).type != "cpu":
        return f"row-invariant forwards run on the CPU only, not {device}"
    if dtype != torch.bfloat16 and not (dtype == torch.float32 and not dense_linears):
        return (f"row-invariant forwards need bfloat16 weights, or float32 with every linear block-quantized, "
                f"not {dtype}" + (" with dense linears" if dtype == torch.float32 else ""))
    from runtime.kernels import cpu_attention  # imports torch._dynamo (about a second): only when asked

    if not cpu_attention.available():
        return f"the C++ CPU kernels are unavailable ({cpu_attention.unavailable_reason()})"
    return None


def linear(module: nn.Module, x: torch.Tensor, invariant: bool) -> torch.Tensor:
    """module(x) for x (..., K); for a dense `nn.Linear` with `invariant`, as calls of MIN_ROWS..MAX_ROWS
    rows (a 1-row input padded with a copy of itself, longer ones split), so each row gets the bits
    it gets in any other call. Other modules (quantized linears) run as they are."""
    if not invariant or type(module) is not nn.Linear:
        return module(x)
    rows = x.reshape(-1, x.shape[-1])  # (M, K)
    M = rows.shape[0]
    if MIN_ROWS <= M <= MAX_ROWS:
        return module(x)
    parts = []
    for chunk in rows.split(MAX_ROWS):  # (<= MAX_ROWS, K)
        n = chunk.shape[0]
        if n < MIN_ROWS:
            chunk = chunk.repeat(MIN_ROWS, 1)  # (MIN_ROWS, K)
        parts.append(F.linear(chunk, module.weight, module.bias)[:n])
    return torch.cat(parts).view(*x.shape[:-1], -1)


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
              prefix_lens: torch.Tensor, window: int | None, block_table: torch.Tensor | None = None,
              num_keys: int = 0) -> torch.Tensor:
    """Row-invariant attention of q (B, Hq, T, D) over keys, values (B, Hkv, S, D) -> (B, Hq, T, D).

    mask: (B, T, S) bool, True = may attend; None = causal on top of each row's `prefix_lens` (B,)
    cached slots, within `window` (None = no window). With a `block_table` (B, W), keys and values
    are a paged layer's pools (NB, Hkv, bs, D), read through it for S = `num_keys` slots a row."""
    from runtime.kernels import cpu_attention  # imports torch._dynamo (about a second): only when asked

    if not cpu_attention.available():
        raise RuntimeError(f"row-invariant attention needs the C++ CPU kernels: {cpu_attention.unavailable_reason()}")
    return cpu_attention.attention_rows(q, keys, values, mask, prefix_lens, window or 0, block_table, num_keys)
