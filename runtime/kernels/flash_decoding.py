"""Flash-decoding: split a long KV cache across programs, then merge the partial softmaxes.

A decode step (one or a few queries per row) gives the tiled attention kernel only
B x H_kv x ceil(T*G / BLOCK_M) programs, far fewer than a GPU has SMs, and each of them walks
the whole cache alone. Flash-decoding cuts the key range [0, S) into `num_splits` chunks, runs
one program per (query tile, row, kv head, chunk) - `runtime.kernels.flash_attention` with
`num_splits > 1` - and each writes its normalised partial output o_s and its log-sum-exp
lse_s = m_s + log2(l_s) (base 2: the kernels use exp2). This module merges them:

    out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M),   M = max_s lse_s

A chunk that saw no visible key has lse_s = -inf and weight 0; a row with no visible key at
all gets 0 (SDPA would give NaN).

Partial layout (one row per packed query: r = t * G + g, G = H_q / H_kv):
o_part (B, H_kv, num_splits, T*G, D) float32, lse_part (B, H_kv, num_splits, T*G) float32.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


def flash_merge_ref(o_part: torch.Tensor, lse_part: torch.Tensor) -> torch.Tensor:
    """Float64 reference merge: (B, Hkv, P, R, D), (B, Hkv, P, R) -> (B, Hkv, R, D)."""
    o, lse = o_part.double(), lse_part.double()
    top = lse.max(dim=2, keepdim=True).values  # (B, Hkv, 1, R)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    w = torch.exp2(lse - top)  # (B, Hkv, P, R)
    denom = w.sum(dim=2)  # (B, Hkv, R)
    num = (w[..., None] * o).sum(dim=2)  # (B, Hkv, R, D)
    return torch.where(denom[..., None] > 0, num / denom.clamp_min(1e-300)[..., None], 0.0)


# ---- configs ----------------------------------------------------------------------------

MAX_SPLITS = 64          # the merge kernel holds all partials of one row in registers
MIN_KEYS_PER_SPLIT = 512  # below this a chunk costs more to merge than it saves


def choose_num_splits(num_programs: int, num_keys: int, block_n: int, num_sms: int) -> int:
    """How many key chunks a launch of `num_programs` (query tiles x rows x kv heads) should use.

    Split only when the launch leaves SMs idle and the cache is long: enough chunks to give
    each SM about two programs, each chunk at least MIN_KEYS_PER_SPLIT keys and at least one
    key tile, at most MAX_SPLITS. Returns 1 for no split.
    """
    if num_programs >= num_sms:
        return 1
    by_length = num_keys // max(MIN_KEYS_PER_SPLIT, block_n)
    by_occupancy = math.ceil(2 * num_sms / num_programs)
    return max(1, min(MAX_SPLITS, by_length, by_occupancy))


# ---- kernel -----------------------------------------------------------------------------

@triton.jit
def _flash_merge_kernel(
    O_part, Lse_part, Out,
    stride_pb, stride_ph, stride_ps, stride_pr,
    stride_lb, stride_lh, stride_ls,
    stride_ob, stride_oh, stride_ot, stride_od,
    HKV, G, R, NUM_SPLITS,
    HEAD_DIM: tl.constexpr, SPLITS_P2: tl.constexpr,
):
    # one program merges one packed query row r of one (b, kv head)
    pid_bh = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1)
    b = pid_bh // HKV
    hkv = pid_bh % HKV
    offs_s = tl.arange(0, SPLITS_P2)
    offs_d = tl.arange(0, HEAD_DIM)
    s_ok = offs_s < NUM_SPLITS
    lse = tl.load(Lse_part + b * stride_lb + hkv * stride_lh + offs_s * stride_ls + r,
                  mask=s_ok, other=float("-inf"))  # (P,)
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.math.exp2(lse - top)  # (P,), 0 for empty chunks
    o_ptrs = (O_part + b * stride_pb + hkv * stride_ph + offs_s[:, None] * stride_ps
              + r * stride_pr + offs_d[None, :])
    o = tl.load(o_ptrs, mask=s_ok[:, None], other=0.0)  # (P, D)
    denom = tl.sum(w, 0)
    num = tl.sum(w[:, None] * o, 0)  # (D,)
    out = num / tl.where(denom > 0, denom, 1.0)
    t = r // G
    h = hkv * G + r % G
    tl.store(Out + b * stride_ob + h * stride_oh + t * stride_ot + offs_d * stride_od,
             out.to(Out.dtype.element_ty))


# ---- launcher ---------------------------------------------------------------------------

def flash_merge(o_part: torch.Tensor, lse_part: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Merge partials (B, Hkv, P, T*G, D) / (B, Hkv, P, T*G) into `out` (B, Hq, T, D); returns out."""
    B, Hkv, P, R, D = o_part.shape
    Bo, Hq, T, Do = out.shape
    assert lse_part.shape == (B, Hkv, P, R), f"lse_part {tuple(lse_part.shape)} != {(B, Hkv, P, R)}"
    assert Bo == B and Do == D and Hq % Hkv == 0 and R == T * (Hq // Hkv), (
        f"out {tuple(out.shape)} does not match partials {tuple(o_part.shape)}")
    assert o_part.dtype == lse_part.dtype == torch.float32, "partials must be float32"
    assert o_part.stride(-1) == 1 and lse_part.stride(-1) == 1, "partials must be contiguous in D / R"
    assert 1 <= P <= MAX_SPLITS, f"num_splits must be in [1, {MAX_SPLITS}], got {P}"
    _flash_merge_kernel[(B * Hkv, R)](
        o_part, lse_part, out,
        o_part.stride(0), o_part.stride(1), o_part.stride(2), o_part.stride(3),
        lse_part.stride(0), lse_part.stride(1), lse_part.stride(2),
        out.stride(0), out.stride(1), out.stride(2), out.stride(3),
        Hkv, Hq // Hkv, R, P,
        HEAD_DIM=D, SPLITS_P2=max(2, triton.next_power_of_2(P)),
    )
    return out
