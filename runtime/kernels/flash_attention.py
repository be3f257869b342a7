"""Tiled online-softmax attention (FlashAttention-2 style) over the static KV cache.

One kernel serves prefill, verification blocks and decoding. Queries q (B, Hq, T, D) attend
to keys/values k, v (B, Hkv, S, D) read in place from the cache (any strides, no copy), never
materialising the T x S score matrix: each program keeps a running max m, sum l and
accumulator acc for BLOCK_M query rows and walks the key range BLOCK_N slots at a time.

Grouped-query attention without repeating K/V: the G = Hq / Hkv query heads that share a kv
head are packed into the rows of one tile (row r = t * G + g is query t of head hkv * G + g),
so each K/V tile is loaded once for the whole group - a decode step with G = 7 fills 7 rows
of a tile instead of 1.

Masks (what query t of row b, at slot prefix_lens[b] + t, may see):
- causal (mask=None): slots [0, prefix_lens[b] + t], and > prefix_lens[b] + t - window when a
  sliding window is set. No mask tensor is read; fully visible tiles skip masking entirely.
- explicit (mask (B, T, S) bool, True = attend): read tile by tile (tree verification).
- tree bits (tree_bits (B, T) int64, T <= 64): the whole cached prefix [0, prefix_lens[b]) plus
  new token j (slot prefix_lens[b] + j) when bit j of tree_bits[b, t] is set (ancestor or self).
In every mode slots >= prefix_lens[b] + T are garbage for row b and never read; a query that
sees no slot gets 0.

Softmax in base 2: log2(e) is folded into the scale, p = exp2(q.k * scale * log2(e) - m).
Dots accumulate in float32 (IEEE for float32 inputs, no TF32). With `num_splits > 1` the key
range is cut into chunks whose partial results `flash_decoding.flash_merge` combines
(flash-decoding); `num_splits=None` picks that automatically for short blocks over long caches.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from runtime.kernels.flash_decoding import MAX_SPLITS, choose_num_splits, flash_merge

_LOG2E = 1.4426950408889634


def visible_mask(prefix_lens: torch.Tensor, num_new: int, num_keys: int, mask: torch.Tensor | None = None,
                 window: int | None = None, tree_bits: torch.Tensor | None = None) -> torch.Tensor:
    """The boolean (B, T, S) mask the kernel applies, built explicitly (for the reference)."""
    device = prefix_lens.device
    t = torch.arange(num_new, device=device)
    key = torch.arange(num_keys, device=device)[None, None, :]  # (1, 1, S)
    qpos = (prefix_lens[:, None] + t)[:, :, None]  # (B, T, 1)
    in_range = key < prefix_lens[:, None, None] + num_new  # (B, 1, S): garbage slots excluded
    if mask is not None:
        return mask.bool() & in_range
    if tree_bits is not None:
        j = key - prefix_lens[:, None, None]  # (B, 1, S): index among the new tokens
        bit = (tree_bits[:, :, None] >> j.clamp(0, 63)) & 1  # (B, T, S)
        return ((key < prefix_lens[:, None, None]) | ((j >= 0) & (bit == 1))) & in_range
    vis = key <= qpos
    if window is not None:
        vis = vis & (key > qpos - window)
    return vis & in_range


def flash_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                        prefix_lens: torch.Tensor | None = None, window: int | None = None,
                        tree_bits: torch.Tensor | None = None) -> torch.Tensor:
    """Float64 reference of `flash_attention` (materialises the scores): returns (B, Hq, T, D) float64."""
    B, Hq, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if prefix_lens is None:
        prefix_lens = torch.zeros(B, dtype=torch.long, device=q.device)
    vis = visible_mask(prefix_lens, T, S, mask, window, tree_bits)  # (B, T, S)
    G = Hq // Hkv
    live = (torch.arange(S, device=q.device)[None, :] < prefix_lens[:, None] + T)[:, None, :, None]  # (B, 1, S, 1)
    kk = torch.where(live, k.double(), 0.0).repeat_interleave(G, dim=1)  # (B, Hq, S, D), garbage -> 0
    vv = torch.where(live, v.double(), 0.0).repeat_interleave(G, dim=1)
    scores = q.double() @ kk.transpose(-1, -2) / math.sqrt(D)  # (B, Hq, T, S)
    scores = scores.masked_fill(~vis[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows with no visible key -> 0
    return probs @ vv


# ---- configs ----------------------------------------------------------------------------

@dataclass(frozen=True)
class FlashConfig:
    """Tile sizes and launch parameters of one `flash_attention` launch."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"FlashConfig.{name} must be a power of two >= 16 (tl.dot), got {value}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"FlashConfig.num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"FlashConfig.num_stages must be >= 1, got {self.num_stages}")


# GPU (Hopper-class) starting points per head dim; `benchmarks/bench_attention.py --parts sweep` re-tunes.
_PREFILL_CONFIGS = {
    16: FlashConfig(128, 64, 4, 3),
    32: FlashConfig(128, 64, 4, 3),
    64: FlashConfig(128, 64, 4, 3),
    128: FlashConfig(128, 64, 8, 3),
    256: FlashConfig(64, 32, 8, 2),
}
_PREFILL_CONFIGS_FP32 = {  # float32 tiles take twice the shared memory (H100: 227 KiB per block)
    16: FlashConfig(64, 64, 4, 2),
    32: FlashConfig(64, 64, 4, 2),
    64: FlashConfig(64, 64, 4, 2),
    128: FlashConfig(128, 32, 8, 2),
    256: FlashConfig(32, 32, 4, 1),
}
_DECODE_CONFIGS = {  # a block of T*G <= 16 packed rows (decode, short verification)
    16: FlashConfig(16, 128, 4, 3),
    32: FlashConfig(16, 128, 4, 3),
    64: FlashConfig(16, 128, 4, 3),
    128: FlashConfig(16, 64, 4, 3),
    256: FlashConfig(16, 32, 4, 2),
}
# Under TRITON_INTERPRET=1 small tiles keep the tests fast and exercise many tile boundaries.
_INTERPRETER_CONFIG = FlashConfig(16, 16, 1, 1)
MAX_TREE_TOKENS = 64  # tree_bits is one int64 per query


def default_config(head_dim: int, rows: int, dtype: torch.dtype, device: torch.device) -> FlashConfig:
    """The tile config for `rows` = T * G packed query rows per kv head of `dtype` on `device`."""
    if device.type != "cuda":
        return _INTERPRETER_CONFIG
    if rows <= 16:
        return _DECODE_CONFIGS[head_dim]
    return (_PREFILL_CONFIGS_FP32 if dtype == torch.float32 else _PREFILL_CONFIGS)[head_dim]


# ---- kernel -----------------------------------------------------------------------------

@triton.jit
def _attn_tiles(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                lo, hi, kv_end, offs_d, qpos, prefix, bits, mask_rows, stride_ms, row_ok, window,
                qk_scale,
                MODE: tl.constexpr, MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr,
                BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
    """Online-softmax update of (acc, l_i, m_i) with key tiles [lo, hi), masked or not."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k_ptrs = k_base + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd  # (D, N)
        v_ptrs = v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd  # (N, D)
        if MASKED:
            in_range = offs_n < kv_end
            kt = tl.load(k_ptrs, mask=in_range[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=in_range[:, None], other=0.0)
        else:
            kt = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        if DOT_F32:  # interpreter bf16 workaround: exact upcast, same products as a bf16 MMA
            kt = kt.to(tl.float32)
        qk = tl.dot(q, kt, input_precision=PRECISION) * qk_scale  # (M, N), log2 units
        if MASKED:
            vis = in_range[None, :] & row_ok[:, None]
            if MODE == 0:  # causal, optionally windowed
                vis = vis & (offs_n[None, :] <= qpos[:, None])
                if HAS_WINDOW:
                    vis = vis & (offs_n[None, :] > qpos[:, None] - window)
            elif MODE == 1:  # explicit boolean mask, one (M, N) tile
                allowed = tl.load(mask_rows[:, None] + offs_n[None, :] * stride_ms, mask=vis, other=0)
                vis = vis & (allowed != 0)
            else:  # ancestor bits over the new tokens, whole prefix visible
                j = offs_n - prefix
                jc = tl.minimum(tl.maximum(j, 0), 63)
                bit = (bits[:, None] >> jc[None, :].to(tl.int64)) & 1
                vis = vis & ((offs_n[None, :] < prefix) | ((j[None, :] >= 0) & (bit != 0)))
            qk = tl.where(vis, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
        p = tl.math.exp2(qk - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        p = p.to(k_base.dtype.element_ty)  # P is rounded to the input dtype, as in FlashAttention-2
        if DOT_F32:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _flash_attn_kernel(
    Q, K, V, Out, Prefix, Mask, Bits, O_part, Lse_part,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_ot, stride_od,
    stride_mb, stride_mt, stride_ms,
    stride_bb, stride_bt,
    stride_pb, stride_ph, stride_ps, stride_pr,
    stride_lb, stride_lh, stride_ls,
    HKV, G, T, S, CHUNK, window, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MODE: tl.constexpr, HAS_WINDOW: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    # heaviest (causal) query tiles first: better load balance at the tail of the grid
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    pid_s = tl.program_id(2)
    b = pid_bh // HKV
    hkv = pid_bh % HKV
    R = T * G
    prefix = tl.load(Prefix + b)
    kv_end = tl.minimum(prefix + T, S)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # packed (t, g) rows
    row_ok = rows < R
    t = rows // G
    h = hkv * G + rows % G
    qpos = prefix + t  # (M,) cache slot of each query
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + b * stride_qb + h[:, None] * stride_qh + t[:, None] * stride_qt
                + offs_d[None, :] * stride_qd, mask=row_ok[:, None], other=0.0)  # (M, D)
    if DOT_F32:
        q = q.to(tl.float32)
    k_base = K + b * stride_kb + hkv * stride_kh
    v_base = V + b * stride_vb + hkv * stride_vh
    t_lo = (pid_m * BLOCK_M) // G
    t_hi = tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // G, T - 1)

    # key range of this program: its chunk, cut to the slots some row of the tile may see
    lo = pid_s * CHUNK
    hi = tl.minimum(kv_end, lo + CHUNK)
    if MODE == 0:
        hi = tl.minimum(hi, prefix + t_hi + 1)
        if HAS_WINDOW:
            lo = tl.maximum(lo, tl.maximum(prefix + t_lo - window + 1, 0) // BLOCK_N * BLOCK_N)
            full_hi = lo  # window edges: mask every tile
        else:
            full_hi = (prefix + t_lo + 1) // BLOCK_N * BLOCK_N  # every row sees these
    elif MODE == 2:
        full_hi = prefix // BLOCK_N * BLOCK_N  # the cached prefix is visible to all
    else:
        full_hi = lo  # an explicit mask is read for every tile
    full_hi = tl.maximum(lo, tl.minimum(full_hi, hi // BLOCK_N * BLOCK_N))

    mask_rows = Mask + b * stride_mb + t * stride_mt  # (M,) pointers, used when MODE == 1
    bits = tl.zeros([BLOCK_M], dtype=tl.int64)
    if MODE == 2:
        bits = tl.load(Bits + b * stride_bb + t * stride_bt, mask=row_ok, other=0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    acc, l_i, m_i = _attn_tiles(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn,
                                stride_vd, lo, full_hi, kv_end, offs_d, qpos, prefix, bits, mask_rows,
                                stride_ms, row_ok, window, qk_scale,
                                MODE, False, HAS_WINDOW, BLOCK_N, PRECISION, DOT_F32)
    acc, l_i, m_i = _attn_tiles(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn,
                                stride_vd, full_hi, hi, kv_end, offs_d, qpos, prefix, bits, mask_rows,
                                stride_ms, row_ok, window, qk_scale,
                                MODE, True, HAS_WINDOW, BLOCK_N, PRECISION, DOT_F32)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # rows that saw no key -> 0
    if SPLIT:
        part = b * stride_pb + hkv * stride_ph + pid_s * stride_ps
        tl.store(O_part + part + rows[:, None] * stride_pr + offs_d[None, :], out, mask=row_ok[:, None])
        lse = tl.where(l_i > 0, m_i + tl.math.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(Lse_part + b * stride_lb + hkv * stride_lh + pid_s * stride_ls + rows, lse, mask=row_ok)
    else:
        tl.store(Out + b * stride_ob + h[:, None] * stride_oh + t[:, None] * stride_ot
                 + offs_d[None, :] * stride_od, out.to(Out.dtype.element_ty), mask=row_ok[:, None])


# ---- launcher ---------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (1 for the interpreter: no automatic split)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def interpreted() -> bool:
    """Whether the kernels were built for the Triton interpreter (TRITON_INTERPRET=1 at import)."""
    return not isinstance(_flash_attn_kernel, triton.runtime.jit.JITFunction)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                    prefix_lens: torch.Tensor | None = None, window: int | None = None,
                    tree_bits: torch.Tensor | None = None, num_splits: int | None = None,
                    config: FlashConfig | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v over the visible cache slots: q (B, Hq, T, D) -> (B, Hq, T, D).

    k, v: (B, Hkv, S, D), Hq a multiple of Hkv, any strides (cache views are read in place).
    mask: bool (B, T, S), True = attend; or tree_bits: int64 (B, T), bit j = new token j is an
    ancestor-or-self of query t (T <= 64); neither = causal. prefix_lens: (B,) cached slots of
    each row before this block (default 0). window: sliding window of the causal mode (an
    explicit mask already encodes its own). num_splits: key chunks (flash-decoding); None picks
    automatically, 1 = one program per (query tile, row, kv head). config: tile override.
    """
    B, Hq, T, D = q.shape
    Bk, Hkv, S, Dk = k.shape
    assert v.shape == k.shape, f"v {tuple(v.shape)} != k {tuple(k.shape)}"
    assert Bk == B and Dk == D, f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch or head dim"
    assert Hq % Hkv == 0, f"query heads ({Hq}) must be a multiple of kv heads ({Hkv})"
    assert T >= 1 and S >= 1, f"empty attention: T={T}, S={S}"
    assert D in _PREFILL_CONFIGS, f"head dim {D} unsupported; use one of {sorted(_PREFILL_CONFIGS)}"
    assert q.dtype == k.dtype == v.dtype and q.dtype in (torch.float16, torch.bfloat16, torch.float32), (
        f"q, k, v must share one of float16 / bfloat16 / float32, got {q.dtype}, {k.dtype}, {v.dtype}")
    assert mask is None or tree_bits is None, "pass an explicit mask or tree_bits, not both"
    if q.device.type != "cuda" and not interpreted():
        raise RuntimeError("the Triton attention kernels need a CUDA GPU; on the CPU use attention='sdpa', "
                           "or set TRITON_INTERPRET=1 before runtime.kernels is imported (tests)")
    device = q.device
    if prefix_lens is None:
        prefix_lens = torch.zeros(B, dtype=torch.long, device=device)
    assert prefix_lens.shape == (B,), f"prefix_lens must be (B,) = ({B},), got {tuple(prefix_lens.shape)}"
    prefix_lens = prefix_lens.to(device=device, dtype=torch.long)
    mode, mask_arg, mask_strides, bits_arg, bits_strides = 0, prefix_lens, (0, 0, 0), prefix_lens, (0, 0)
    if mask is not None:
        assert mask.shape == (B, T, S) and mask.dtype == torch.bool, (
            f"mask must be bool (B, T, S) = ({B}, {T}, {S}), got {mask.dtype} {tuple(mask.shape)}")
        mode, mask_arg = 1, mask.view(torch.uint8)
        mask_strides = mask_arg.stride()
    elif tree_bits is not None:
        assert tree_bits.shape == (B, T) and tree_bits.dtype == torch.long, (
            f"tree_bits must be int64 (B, T) = ({B}, {T}), got {tree_bits.dtype} {tuple(tree_bits.shape)}")
        assert T <= MAX_TREE_TOKENS, f"tree_bits holds at most {MAX_TREE_TOKENS} new tokens, got T={T}"
        assert window is None, "tree_bits takes no sliding window; pass an explicit mask instead"
        mode, bits_arg, bits_strides = 2, tree_bits, tree_bits.stride()
    has_window = mode == 0 and window is not None
    assert not has_window or window >= 1, f"window must be >= 1, got {window}"

    G = Hq // Hkv
    cfg = config or default_config(D, T * G, q.dtype, device)
    m_tiles = triton.cdiv(T * G, cfg.block_m)
    if num_splits is None:
        num_splits = choose_num_splits(m_tiles * B * Hkv, S, cfg.block_n, _num_sms(device))
    assert 1 <= num_splits <= MAX_SPLITS, f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}"
    chunk = triton.cdiv(triton.cdiv(S, num_splits), cfg.block_n) * cfg.block_n
    num_splits = triton.cdiv(S, chunk)  # no empty trailing chunk

    # (B, T, Hq, D) storage viewed as (B, Hq, T, D): the caller's transpose(1, 2) is then free
    out = torch.empty(B, T, Hq, D, dtype=q.dtype, device=device).transpose(1, 2)
    split = num_splits > 1
    if split:
        o_part = torch.empty(B, Hkv, num_splits, T * G, D, dtype=torch.float32, device=device)
        lse_part = torch.empty(B, Hkv, num_splits, T * G, dtype=torch.float32, device=device)
    else:
        o_part = lse_part = out
    p_strides = o_part.stride()[:4] if split else (0, 0, 0, 0)
    l_strides = lse_part.stride()[:3] if split else (0, 0, 0)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    _flash_attn_kernel[(m_tiles, B * Hkv, num_splits)](
        q, k, v, out, prefix_lens, mask_arg, bits_arg, o_part, lse_part,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        *mask_strides, *bits_strides, *p_strides, *l_strides,
        Hkv, G, T, S, chunk, window or 0, _LOG2E / math.sqrt(D),
        HEAD_DIM=D, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        MODE=mode, HAS_WINDOW=has_window, SPLIT=split, PRECISION=precision,
        # the interpreter multiplies bf16 as raw uint16 bits (Triton 3.9): upcast there only
        DOT_F32=interpreted() and q.dtype == torch.bfloat16,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if split:
        flash_merge(o_part, lse_part, out)
    return out
