"""GGUF blocks of specdec's quantized linears: exact where the layout maps, re-quantized otherwise.

Exact maps (the same codes; only the block scales are rounded to float16, as GGUF stores them):

- `Int4Linear` with groups of a multiple of 32 -> Q4_1. Ours: w = (q - 8) * s + z per group;
  Q4_1: w = d * q + m per 32 weights, so d = s and m = z - 8 s, repeated over the group's blocks.
- `Int8Linear` (per output channel, symmetric) -> Q8_0: d = s for every block of the row, the same
  int8 codes.

Every other format (NF4, 2:4 + INT4, INT4 in groups of 16, LLM.int8) is dequantized and rounded
again by gguf-py's reference quantizer (`gguf.quants.quantize`, llama.cpp's round-to-nearest
min/max for Q4_1, absmax for Q8_0), or kept as a float tensor ("dense"). `block_error` measures
what a GGUF tensor dequantizes to against the module's own weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from runtime.qlinear import Int4Linear, Int8Linear, QuantizedLinear

QK = 32  # weights per Q4_1 / Q8_0 block
GGUF_TYPES = {"q4_1": GGMLQuantizationType.Q4_1, "q8_0": GGMLQuantizationType.Q8_0}
REQUANT = ("auto", "q4_1", "q8_0", "dense")
# what `requant="auto"` does with a format that has no exact GGUF type: the GGUF type of its width
AUTO_REQUANT = {"int4": "q4_1", "nf4": "q4_1", "sparse24_int4": "q4_1", "int8": "q8_0", "int8_mixed": "q8_0"}


@dataclass(frozen=True)
class Blocks:
    """One GGUF tensor: `data` (rows, bytes per row) uint8 blocks of `qtype`, `exact` when they hold the
    module's own codes (not a re-quantization)."""

    data: np.ndarray
    qtype: GGMLQuantizationType
    exact: bool


def _f16_bytes(x: torch.Tensor) -> torch.Tensor:
    """(..., n) float -> (..., n, 2) uint8: the float16 values' bytes (little-endian, as GGUF stores them)."""
    return x.to(torch.float16).contiguous().view(torch.uint8).view(*x.shape, 2)


def _q4_1_exact(mod: Int4Linear, rows: torch.Tensor) -> np.ndarray:
    codes = mod.codes()[rows].to(torch.uint8)  # (R, K)
    R, K = codes.shape
    rep = mod.group_size // QK
    s = mod.scales[rows].to(torch.float32)  # (R, K/G)
    d = s.repeat_interleave(rep, dim=1)  # (R, K/32)
    m = (mod.zeros[rows].to(torch.float32) - 8 * s).repeat_interleave(rep, dim=1)  # (R, K/32)
    q = codes.view(R, K // QK, 2, QK // 2)  # byte j of a block: weight j (low nibble), weight j + 16 (high)
    qs = q[:, :, 0] | (q[:, :, 1] << 4)  # (R, K/32, 16)
    return torch.cat([_f16_bytes(d), _f16_bytes(m), qs], dim=-1).view(R, -1).numpy()


def _q8_0_exact(mod: Int8Linear, rows: torch.Tensor) -> np.ndarray:
    q = mod.qweight[rows]  # (R, K) int8
    R, K = q.shape
    d = mod.scales[rows].to(torch.float32)[:, None].expand(R, K // QK)  # (R, K/32)
    qs = q.contiguous().view(torch.uint8).view(R, K // QK, QK)
    return torch.cat([_f16_bytes(d), qs], dim=-1).view(R, -1).numpy()


def exact_type(mod: QuantizedLinear) -> str | None:
    """The GGUF type `mod`'s codes map onto exactly, or None."""
    if isinstance(mod, Int4Linear) and mod.group_size % QK == 0:
        return "q4_1"
    if isinstance(mod, Int8Linear) and mod.in_features % QK == 0:
        return "q8_0"
    return None


def target_type(mod: QuantizedLinear, requant: str = "auto") -> str:
    """What a linear of `mod`'s format becomes: its exact type, else `requant` ("auto": the GGUF type of
    the format's width, "dense" for formats without one such as 2:4 sparse); one of GGUF_TYPES or "dense"."""
    if requant not in REQUANT:
        raise ValueError(f"requant must be one of {REQUANT}, got {requant!r}")
    exact = exact_type(mod)
    if exact is not None:
        return exact
    kind = AUTO_REQUANT.get(mod.FORMAT, "dense") if requant == "auto" else requant
    if kind != "dense" and mod.in_features % QK:
        return "dense"  # GGUF's blocks need rows of a multiple of 32 weights
    return kind


def to_blocks(mod: QuantizedLinear, rows: torch.Tensor, kind: str) -> Blocks:
    """Output channels `rows` (a 1-D index tensor, in the order GGUF wants them) of `mod` as `kind` blocks:
    the exact map when `mod` has one onto `kind`, else its dequantized weights quantized by gguf-py."""
    qtype = GGUF_TYPES[kind]
    if exact_type(mod) == kind:
        data = _q4_1_exact(mod, rows) if kind == "q4_1" else _q8_0_exact(mod, rows)
        return Blocks(data, qtype, exact=True)
    w = mod.dequantize(torch.float32)[rows].numpy()
    return Blocks(quantize(w, qtype), qtype, exact=False)


def block_error(data: np.ndarray, qtype: GGMLQuantizationType, reference: torch.Tensor) -> tuple[float, float]:
    """(relative Frobenius error, max |error|) of GGUF tensor `data` against `reference` (rows, K) float32."""
    got = torch.from_numpy(np.array(dequantize(data, qtype), dtype=np.float32))  # a copy: the file is read-only
    diff = got - reference
    norm = float(reference.norm())
    return (float(diff.norm()) / norm if norm else float(diff.norm())), float(diff.abs().max())
