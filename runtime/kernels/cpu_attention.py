"""Attention on the CPU in C++: the compiled step's cache attention and the row-invariant attention.

Both ops are compiled into the runtime's C++ extension (`cpu_attention.cpp`, `cpu_attention_isa.cpp`,
`cpu_attention_rows.h`; `runtime.kernels.extension` builds and loads it: `available()`,
`unavailable_reason()`):

- `cache_attention`: `runtime.attention.cache_attention` (write a layer's new K/V into the static
  cache, then attend) in one C++ call, what a compiled CPU step runs per layer;
- `attention_rows`: each query alone over its visible keys in slot order, in one fixed float32
  arithmetic, so a row's result does not depend on the other queries, rows or padding
  (`runtime.invariant.attention`). It is built three times (AVX-512, AVX2 + FMA, portable C++), all
  giving the same bits; a call runs the best one the CPU has, or the one `$SPECDEC_ATTENTION_ISA`
  names (`ISA_ENV`: auto, avx512, avx2, generic; how tests run every build on one CPU).
"""

from __future__ import annotations

import torch

from runtime.kernels.extension import available, ops, unavailable_reason

__all__ = ["ISA_ENV", "available", "unavailable_reason", "cache_attention", "attention_rows"]

ISA_ENV = "SPECDEC_ATTENTION_ISA"  # the build attention_rows runs (read by the kernel on every call)


def cache_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, layer: int, prefix_lens: torch.Tensor, window: int,
                    block_mask: torch.Tensor | None, invariant: bool = False,
                    block_table: torch.Tensor | None = None) -> torch.Tensor:
    """`runtime.attention.cache_attention` in C++ (same arguments, same numbers and cache writes):
    k, v (B, Hkv, T, D) written into layer `layer` of k_cache, v_cache (L, B, Hkv, S_max, D) at slots
    prefix_lens[b] + t (with a `block_table` (B, W): the pools (L, NB, Hkv, bs, D) of a
    `runtime.paged_cache.PagedKVCache`), then q (B, Hq, T, D) attends -> (B, Hq, T, D). Needs `available()`."""
    return ops().cache_attention(q, k, v, k_cache, v_cache, layer, prefix_lens, window, block_mask, invariant,
                                 block_table)


def attention_rows(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                   prefix_lens: torch.Tensor, window: int, block_table: torch.Tensor | None = None,
                   num_keys: int = 0) -> torch.Tensor:
    """Row-invariant attention of q (B, Hq, T, D) over keys, values (B, Hkv, S, D) -> (B, Hq, T, D).
    mask (B, T, S) bool, True = may attend; None = causal on top of each row's `prefix_lens` (B,)
    cached slots, within `window` (0 = none). With a `block_table` (B, W), keys and values are a
    paged layer's pools (NB, Hkv, bs, D) and S = `num_keys` slots of each row are read through it.
    Needs `available()`."""
    return ops().attention_rows(q, keys, values, mask, prefix_lens, window, block_table, num_keys)
