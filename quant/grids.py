"""Quantization grids and round-to-nearest: INT8 per channel, INT4 per group, 2:4 masks.

Scales and zeros are rounded to bfloat16 when they are chosen, so the grid used while
quantizing (RTN or GPTQ) is exactly the grid the stored checkpoint and the kernels use.
INT4 zeros come in two kinds (Int4WeightOnly.zero_point): "float" (any bf16 zero) and "integer"
(w = (q - z) * s with an integer z in [0, 15], as compressed-tensors / GPTQ store it). An integer
grid's zero in our kernel form, (8 - z) * s, is kept in float32, where it is exact (a bf16 scale
times an integer of at most 4 bits fits float32's mantissa; bf16 would round it).
"""

from __future__ import annotations

import torch

from quant.config import INT4_GRIDS, ZERO_POINTS
from runtime.qlinear import Int4Linear, Int8Linear, pack_int4

GRID_DTYPE = torch.bfloat16


def int8_rtn(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
    """Symmetric per-output-channel INT8: scale = absmax / 127, codes in [-127, 127]."""
    w = weight.to(torch.float32)
    scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-8).to(GRID_DTYPE)  # (N,)
    q = torch.round(w / scales.to(torch.float32)[:, None]).clamp(-127, 127).to(torch.int8)
    return Int8Linear(q, scales, bias)


GRID_SEARCH_RATIOS = tuple(1 - i / 100 for i in range(1, 21))  # 0.99 ... 0.80: the "mse" grid's clips


def _minmax_grid(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = ((hi - lo) / 15).clamp(min=1e-6).to(GRID_DTYPE)
    zero = (lo + 8 * scale.to(torch.float32)).to(GRID_DTYPE)
    return scale.to(torch.float32), zero.to(torch.float32)


def _integer_grid(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Min-max grid of [min(lo, 0), max(hi, 0)] with an integer zero point z = round(-lo / s) in [0, 15]."""
    lo, hi = lo.clamp(max=0), hi.clamp(min=0)
    scale = ((hi - lo) / 15).clamp(min=1e-6).to(GRID_DTYPE).to(torch.float32)
    z = torch.round(-lo / scale).clamp(0, 15)
    return scale, (8 - z) * scale  # zero in the kernel form, exact in float32


def int4_grid(w: torch.Tensor, grid: str = "mse", importance: torch.Tensor | None = None,
              zero_point: str = "float") -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric grid of each row of `w` (N, G): scale and zero (N,) as float32.

    Dequantization is (q - 8) * scale + zero for codes q in [0, 15], so zero = min + 8 * scale.
    grid "minmax" spans [min, max] of the row. "mse" (after the GPTQ reference's `mse` option)
    also tries the range shrunk to 0.99 ... 0.80 of its width and keeps, per row, the grid with
    the smallest squared rounding error: clipping the rare extreme weights buys a finer step for
    all the others. It is never worse than "minmax" (ratio 1 is the start).
    `importance` (broadcast to w, e.g. GPTQ's diag(H) per input) weights each weight's error in
    that choice, so the clip spares the weights that see the largest inputs.
    zero_point "float": scale and zero are bf16 values, the range shrinks about its midpoint.
    "integer": the range is widened to contain 0 and shrinks towards 0 (as in the GPTQ reference),
    the scale is a bf16 value and zero = (8 - z) * scale for an integer z in [0, 15] (float32, exact).
    """
    if grid not in INT4_GRIDS:
        raise ValueError(f"INT4 grid must be one of {INT4_GRIDS}, got {grid!r}")
    if zero_point not in ZERO_POINTS:
        raise ValueError(f"INT4 zero_point must be one of {ZERO_POINTS}, got {zero_point!r}")
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    integer = zero_point == "integer"
    make = _integer_grid if integer else _minmax_grid
    best_scale, best_zero = make(lo, hi)
    if grid == "minmax":
        return best_scale, best_zero
    best_err = _rounding_error(w, best_scale, best_zero, importance)
    mid, half = (lo + hi) / 2, (hi - lo) / 2
    for ratio in GRID_SEARCH_RATIOS:
        if integer:  # about 0, which the grid must hold
            scale, zero = make(ratio * lo, ratio * hi)
        else:
            scale, zero = make(mid - ratio * half, mid + ratio * half)
        err = _rounding_error(w, scale, zero, importance)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, scale, best_scale)
        best_zero = torch.where(better, zero, best_zero)
    return best_scale, best_zero


def _rounding_error(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                    importance: torch.Tensor | None = None) -> torch.Tensor:
    """Squared error (weighted by `importance` if given) of rounding each row of `w` (..., G) to its grid: (...,)."""
    s, z = scale[..., None], zero[..., None]
    err = (int4_dequant(int4_codes(w, s, z), s, z) - w).square()
    return (err if importance is None else err * importance).sum(dim=-1)


def int4_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Round `w` (N, ...) to the grid (scale, zero broadcast): codes in [0, 15] as float32."""
    return torch.round((w - zero) / scale + 8).clamp(0, 15)


def int4_dequant(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return (codes - 8) * scale + zero


def int4_module(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                bias: torch.Tensor | None, zero_point: str = "float") -> Int4Linear:
    """Build the Int4Linear from (N, K) codes and (N, K/G) float32 scales / zeros (integer zeros stay float32)."""
    zero_dtype = torch.float32 if zero_point == "integer" else GRID_DTYPE
    return Int4Linear(pack_int4(codes.to(torch.int32)), scales.to(GRID_DTYPE).contiguous(),
                      zeros.to(zero_dtype).contiguous(), group_size, bias, zero_point=zero_point)


def check_group_size(name: str, in_features: int, group_size: int) -> None:
    if in_features % group_size:
        raise ValueError(f"group_size {group_size} does not divide the input width {in_features} of {name}; "
                         f"choose a group size that divides it, or exclude {name} with exclude=(...)")


def int4_rtn(weight: torch.Tensor, group_size: int, bias: torch.Tensor | None = None,
             grid: str = "mse", zero_point: str = "float") -> Int4Linear:
    """Round-to-nearest INT4 with one grid (see int4_grid) per group of `group_size` inputs."""
    N, K = weight.shape
    w = weight.to(torch.float32).view(N, K // group_size, group_size)  # (N, K/G, G)
    scale, zero = int4_grid(w, grid, zero_point=zero_point)  # (N, K/G)
    codes = int4_codes(w, scale[..., None], zero[..., None]).view(N, K)
    return int4_module(codes, scale, zero, group_size, bias, zero_point)


def mask_24(scores: torch.Tensor) -> torch.Tensor:
    """Prune mask (True = drop) of the 2 lowest scores in every group of 4 columns. scores: (N, K)."""
    N, K = scores.shape
    if K % 4:
        raise ValueError(f"2:4 sparsity needs the input width divisible by 4, got {K}")
    groups = scores.view(N, K // 4, 4)
    drop = groups.argsort(dim=-1, stable=True)[..., :2]  # (N, K/4, 2)
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, drop, True)
    return mask.view(N, K)
