"""GGUF quantized tensors -> BlockQuantLinear's general form, exactly (no re-quantization).

Each parser reads a tensor's raw blocks (`gguf.GGUFReader` data: (rows, bytes per row) uint8)
and returns the codes and scales of `runtime.blockq`:

    W[n, k] = d[n, k // S] * sc[n, k // G] * q[n, k] - dm[n, k // S] * mc[n, k // G]

| GGUF type | ggml's formula | bits | G | S | sc, mc | d, dm |
|---|---|---|---|---|---|---|
| Q4_K | d sc q - dmin m (6-bit sc, m) | 4 | 32 | 256 | sc, m | d, dmin |
| Q5_K | as Q4_K, 5-bit q | 5 | 32 | 256 | sc, m | d, dmin |
| Q6_K | d sc (q - 32), int8 sc, 6-bit q | 6 | 16 | 256 | sc, sc | d, 32 d |
| Q4_0 | d (q - 8) | 4 | 32 | 32 | 1, 1 | d, 8 d |
| Q4_1 | d q + m | 4 | 32 | 32 | 1, 1 | d, -m |
| Q5_0 | d (q - 16), 5-bit q | 5 | 32 | 32 | 1, 1 | d, 16 d |
| Q5_1 | d q + m, 5-bit q | 5 | 32 | 32 | 1, 1 | d, -m |
| Q8_0 | d q, int8 q (stored as q + 128) | 8 | 32 | 32 | 1, 1 | d, 128 d |

The fp16 scales widen to float32 exactly, and every product d * sc * q is exact in float32 (at
most 24 significant bits), so `BlockQuantLinear.dequantize()` equals `gguf.quants.dequantize`
bit for bit (tested).
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np
import torch
from gguf.quants import Q4_K

QK_K = 256


@dataclass(frozen=True)
class Canonical:
    """One tensor in the general form: q (N, K) uint8, sc / mc (N, K/G) int8, d / dm (N, K/S) float32."""

    q: torch.Tensor
    sc: torch.Tensor
    mc: torch.Tensor
    d: torch.Tensor
    dm: torch.Tensor
    bits: int
    group_size: int
    super_block: int

    def rows(self, index: torch.Tensor) -> "Canonical":
        """The same tensor with its rows (output channels) reordered by `index`."""
        return Canonical(self.q[index], self.sc[index], self.mc[index], self.d[index], self.dm[index], self.bits,
                         self.group_size, self.super_block)


def _f16(raw: np.ndarray) -> np.ndarray:
    """(n, 2) uint8 -> (n,) float32 from fp16."""
    return raw.copy().view(np.float16).astype(np.float32).reshape(-1)


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """(n, c * width / 2) packed bytes -> (n, c * width) codes: each chunk of width/2 bytes holds
    `width` codes, the low nibbles first (ggml's order)."""
    n = qs.shape[0]
    chunks = qs.reshape(n, -1, 1, width // 2) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (chunks & 0x0F).reshape(n, -1)


def _q4_k(blocks: np.ndarray):
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16])
    q = _nibbles(blocks[:, 16:], 64)  # (n, 256): sub-block 2j = low nibbles of chunk j, 2j + 1 = high
    return q, sc, m, d, dmin, 4, 32, QK_K


def _q5_k(blocks: np.ndarray):
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16])
    qh = blocks[:, 16:48].reshape(n, 1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
    ql = _nibbles(blocks[:, 48:], 64)
    q = ql | ((qh & 1).reshape(n, QK_K) << 4)
    return q, sc, m, d, dmin, 5, 32, QK_K


def _q6_k(blocks: np.ndarray):
    n = blocks.shape[0]
    ql = blocks[:, :128].reshape(n, -1, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    ql = (ql & 0x0F).reshape(n, -1, 32)
    qh = blocks[:, 128:192].reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    qh = (qh & 0x03).reshape(n, -1, 32)
    q = (ql | (qh << 4)).reshape(n, QK_K)  # codes 0..63, w = d sc (q - 32)
    sc = blocks[:, 192:208].copy().view(np.int8)  # (n, 16)
    d = _f16(blocks[:, 208:210])
    return q, sc, sc, d, 32 * d, 6, 16, QK_K


def _legacy(blocks: np.ndarray, kind: str):
    """Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: blocks of 32 with an fp16 scale (and min)."""
    n = blocks.shape[0]
    d = _f16(blocks[:, 0:2])
    ones = np.ones((n, 1), dtype=np.int8)
    if kind == "Q8_0":
        q = (blocks[:, 2:34].copy().view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return q, ones, ones, d, 128 * d, 8, 32, 32
    has_min = kind in ("Q4_1", "Q5_1")
    body = blocks[:, 4:] if has_min else blocks[:, 2:]
    minus = -_f16(blocks[:, 2:4]) if has_min else None
    if kind.startswith("Q5"):
        qh = body[:, :4].copy().view(np.uint32).reshape(n, 1) >> np.arange(32, dtype=np.uint32).reshape(1, 32)
        q = _nibbles(body[:, 4:], 32) | ((qh & 1).astype(np.uint8) << 4)
        return q, ones, ones, d, minus if has_min else 16 * d, 5, 32, 32
    q = _nibbles(body, 32)
    return q, ones, ones, d, minus if has_min else 8 * d, 4, 32, 32


_PARSERS = {"Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k,
            **{kind: (lambda b, kind=kind: _legacy(b, kind)) for kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")}}
SUPPORTED = tuple(_PARSERS)


def to_canonical(raw: np.ndarray, kind: str, shape: tuple[int, int]) -> Canonical:
    """A GGUF tensor's raw data (rows, row bytes) of type `kind` ("Q4_K", ...) and (N, K) shape ->
    `Canonical`. KeyError for a type outside SUPPORTED."""
    N, K = shape
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    blocks = np.ascontiguousarray(raw).reshape(-1, block_bytes)
    if blocks.shape[0] * block_size != N * K:
        raise ValueError(f"{kind} tensor of shape {shape} holds {blocks.shape[0]} blocks of {block_size}")
    q, sc, mc, d, dm, bits, G, S = _PARSERS[kind](blocks)

    def t(a: np.ndarray, cols: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).reshape(N, cols).to(dtype)

    return Canonical(t(q, K, torch.uint8), t(sc, K // G, torch.int8), t(mc, K // G, torch.int8),
                     t(d, K // S, torch.float32), t(dm, K // S, torch.float32), bits, G, S)


def widen(c: Canonical, bits: int, group_size: int, super_block: int) -> Canonical:
    """The same weights on a finer grid (more bits, smaller groups, smaller super-blocks), exactly:
    codes keep their values, each scale is repeated over the groups it covered."""
    if bits < c.bits or c.group_size % group_size or c.super_block % super_block or super_block % group_size:
        raise ValueError(f"cannot widen ({c.bits}, {c.group_size}, {c.super_block}) to ({bits}, {group_size}, "
                         f"{super_block})")
    g, s = c.group_size // group_size, c.super_block // super_block
    return Canonical(c.q, c.sc.repeat_interleave(g, 1), c.mc.repeat_interleave(g, 1), c.d.repeat_interleave(s, 1),
                     c.dm.repeat_interleave(s, 1), bits, group_size, super_block)


def concat(parts: list[Canonical]) -> Canonical:
    """Stack tensors along their rows (a fused q/k/v or gate/up projection), widening every part to
    the finest grid among them first (`widen`)."""
    bits = max(p.bits for p in parts)
    G = min(p.group_size for p in parts)
    S = min(p.super_block for p in parts)
    parts = [widen(p, bits, G, S) if (p.bits, p.group_size, p.super_block) != (bits, G, S) else p for p in parts]
    return Canonical(*(torch.cat([getattr(p, f) for p in parts]) for f in ("q", "sc", "mc", "d", "dm")), bits, G, S)
