"""The attention backend function: one entry point, PyTorch SDPA or the Triton flash kernels.

Every backend computes softmax(q k^T / sqrt(D) + mask) v over the first S slots of the static
cache, with grouped-query attention (H_q a multiple of H_kv) and no repeated K/V in memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.cache import write_slots
from runtime.invariant import attention as invariant_attention
from runtime.paged_cache import paged_kv, paged_write

BACKENDS = ("sdpa", "triton")


def default_backend(device: torch.device | str) -> str:
    """`triton` on CUDA when Triton imports, else `sdpa`."""
    if torch.device(device).type == "cuda":
        try:
            import triton  # noqa: F401  (optional: only whether it is installed)
        except ImportError:
            return "sdpa"
        return "triton"
    return "sdpa"


def causal_mask(prefix_lens: torch.Tensor, num_new: int, num_keys: int,
                window: int | None = None) -> torch.Tensor:
    """Boolean (B, T, S) mask: query t of row b sees slots [0, prefix_lens[b] + t] (within window)."""
    device = prefix_lens.device
    query_slot = prefix_lens[:, None] + torch.arange(num_new, device=device)  # (B, T)
    key_slot = torch.arange(num_keys, device=device)  # (S,)
    mask = key_slot[None, None, :] <= query_slot[:, :, None]  # (B, T, S)
    if window is not None:
        mask &= key_slot[None, None, :] > query_slot[:, :, None] - window
    return mask


def block_mask_keys(prefix_lens: torch.Tensor, block_mask: torch.Tensor, num_keys: int,
                    positions: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """Boolean (B, T, S) mask for T new tokens written at slots prefix_lens[b] + t, from the block
    mask (B, T, T) of which new tokens each new token sees (a tree: its ancestors and itself).

    Every token sees its row's cached slots [0, prefix_lens[b]) and the new tokens its block-mask
    row allows; other slots (other rows' padding) are hidden. With a sliding `window`, a key is
    also hidden once it lies `window` or more positions behind the query: the new tokens sit at
    `positions` (B, T), a cached slot s at position s.
    """
    B, T = block_mask.shape[:2]
    slot = torch.arange(num_keys, device=prefix_lens.device)  # (S,)
    rel = slot[None, :] - prefix_lens[:, None]  # (B, S): the key's index among the new tokens
    in_block = (rel >= 0) & (rel < T)
    idx = rel.clamp(0, T - 1)  # (B, S)
    block_part = block_mask.gather(2, idx[:, None, :].expand(B, T, num_keys))  # (B, T, S)
    mask = (rel < 0)[:, None, :] | (in_block[:, None, :] & block_part)
    if window is not None:
        k_pos = torch.where(in_block, positions.gather(1, idx), slot[None, :])  # (B, S)
        mask &= (positions[:, :, None] - k_pos[:, None, :]) < window
    return mask


def sdpa_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """PyTorch SDPA of q (B, Hq, T, D) over k, v (B, Hkv, S, D), mask boolean (B, T, S) or None
    (all visible) -> (B, Hq, T, D).

    Grouped-query attention runs as plain attention with the G = Hq / Hkv query heads of each KV
    head folded into the query axis: q viewed as (B, Hkv, G*T, D), the mask repeated G times.
    The same numbers as `enable_gqa=True`, which PyTorch's CPU kernel runs several times slower.
    """
    B, Hq, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if Hq == Hkv:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask[:, None])
    G = Hq // Hkv  # query head h reads KV head h // G
    qf = q.reshape(B, Hkv, G * T, D)  # (B, Hkv, G*T, D): row g*T + t is query head kv*G + g, position t
    mf = None if mask is None else mask[:, None, None].expand(B, 1, G, T, S).reshape(B, 1, G * T, S)
    out = F.scaled_dot_product_attention(qf, k, v, attn_mask=mf)  # (B, Hkv, G*T, D)
    return out.reshape(B, Hq, T, D)  # CUDA's SDPA kernels may return a transposed layout that view() refuses


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           prefix_lens: torch.Tensor, backend: str = "sdpa",
           window: int | None = None) -> torch.Tensor:
    """Attention of q (B, Hq, T, D) over k, v (B, Hkv, S, D) -> (B, Hq, T, D).

    mask: boolean (B, T, S), True = may attend; None means causal on top of each row's
    `prefix_lens` (B,) cached slots (and the sliding `window`, if any). backend "triton" attends
    with SDPA where autograd needs the result's gradient (the Triton kernel has no backward), and
    in the autocast dtype under autocast.
    """
    if backend == "sdpa":
        if mask is None:
            mask = causal_mask(prefix_lens, q.shape[2], k.shape[2], window)
        return sdpa_gqa(q, k, v, mask)
    if backend == "triton":
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            # a training forward (draft distillation on a GPU): the kernel has no backward, SDPA the same function
            return attend(q, k, v, mask, prefix_lens, "sdpa", window)
        if torch.is_autocast_enabled(q.device.type):  # RoPE leaves q, k in float32 and v in the autocast dtype
            dtype = torch.get_autocast_dtype(q.device.type)
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        from runtime.kernels.flash_attention import flash_attention  # Triton: optional, for CUDA GPUs

        return flash_attention(q, k, v, mask=mask, prefix_lens=prefix_lens, window=window)
    raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")



@torch.library.custom_op("specdec::cache_attention", mutates_args=("k_cache", "v_cache"))
def cache_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, layer: int, prefix_lens: torch.Tensor, window: int,
                    block_mask: torch.Tensor | None, invariant: bool = False,
                    block_table: torch.Tensor | None = None) -> torch.Tensor:
    """Write k, v (B, Hkv, T, D) into layer `layer` of the cache buffers (L, B, Hkv, S_max, D) at
    slots prefix_lens[b] + t, then attend causally: query t of q (B, Hq, T, D) sees slots
    [0, prefix_lens[b] + t] of its row (within `window`, 0 = none). -> (B, Hq, T, D), contiguous.
    With a `block_table` (B, W) the buffers are a paged cache's pools (L, NB, Hkv, bs, D), written and
    read through it (`runtime.paged_cache`). With a `block_mask` (B, T, T) (a Medusa tree step) query t
    sees the row's cached slots and the new tokens its block-mask row allows (`block_mask_keys`); the
    window must then not cut into the row (the caller runs such steps eagerly). invariant: attend
    with the row-invariant kernel (`runtime.invariant.attention`) instead of SDPA.

    One opaque, in-place op for `torch.compile` (`Transformer.static_step`). Left to the compiler,
    the cache write becomes a copy of the whole buffer per layer (functionalization) and the
    attention a masked product over every slot, both growing with the cache size. Here the write is in place and the
    attention is PyTorch's SDPA over the used slots only.
    """
    T = q.shape[2]
    slots = prefix_lens[:, None] + torch.arange(T, device=q.device)  # (B, T)
    uniform = bool((prefix_lens == prefix_lens[0]).all())
    num_keys = int(prefix_lens.max()) + T
    win = window or None
    if block_table is None:
        write_slots(k_cache, v_cache, layer, k, v, slots, uniform)
        keys, values = k_cache[layer][:, :, :num_keys], v_cache[layer][:, :, :num_keys]  # (B, Hkv, S, D)
    else:
        paged_write(k_cache, v_cache, layer, k, v, slots, block_table)
        # the invariant kernel reads the pools through the table; SDPA needs the rows gathered
        keys, values = (None, None) if invariant else paged_kv(k_cache, v_cache, layer, block_table, num_keys)

    def invariant_rows(mask: torch.Tensor | None) -> torch.Tensor:
        if block_table is None:
            return invariant_attention(q, keys, values, mask, prefix_lens, win)
        return invariant_attention(q, k_cache[layer], v_cache[layer], mask, prefix_lens, win, block_table, num_keys)

    if block_mask is not None:
        if win is not None and num_keys > win:
            raise ValueError(f"a block-mask step over {num_keys} slots needs the {win}-token sliding window "
                             "applied by position: run it eagerly (Transformer.forward does)")
        mask = block_mask_keys(prefix_lens, block_mask, num_keys)  # (B, T, S)
        if invariant:
            return invariant_rows(mask)
        return sdpa_gqa(q, keys, values, mask).contiguous()
    if invariant:
        return invariant_rows(None)
    if T == 1 and uniform and (win is None or num_keys <= win):
        out = sdpa_gqa(q, keys, values, None)
    else:
        out = sdpa_gqa(q, keys, values, causal_mask(prefix_lens, T, num_keys, win))  # mask (B, T, S)
    return out.contiguous()


def static_cache_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, layer: int, prefix_lens: torch.Tensor, window: int,
                           block_mask: torch.Tensor | None, invariant: bool = False,
                           block_table: torch.Tensor | None = None) -> torch.Tensor:
    """`cache_attention` for a compiled step: on the CPU the same computation in C++ when the CPU
    extension is built (`runtime.kernels.cpu_attention.cache_attention`: no Python per layer and
    step), else the Python op. Arguments and result as `cache_attention`."""
    if q.device.type == "cpu":
        from runtime.kernels import cpu_blockq  # builds or loads the C++ extension: only on the CPU path

        if cpu_blockq.available():
            return cpu_blockq.ops().cache_attention(q, k, v, k_cache, v_cache, layer, prefix_lens, window,
                                                    block_mask, invariant, block_table)
    return cache_attention(q, k, v, k_cache, v_cache, layer, prefix_lens, window, block_mask, invariant, block_table)


@cache_attention.register_fake
def _cache_attention_shape(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, layer: int, prefix_lens: torch.Tensor,
                           window: int, block_mask: torch.Tensor | None, invariant: bool = False,
                           block_table: torch.Tensor | None = None) -> torch.Tensor:
    return q.new_empty(q.shape)
