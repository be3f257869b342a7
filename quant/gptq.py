"""GPTQ and SparseGPT: one column-by-column solver with second-order error feedback.

H = 2 X X^T / n from a layer's calibration inputs, damped by `damp * mean(diag H)`;
U = upper Cholesky factor of H^-1. Columns are processed left to right in blocks; each
column is quantized (GPTQ, INT4 grid per group of inputs) and/or pruned (SparseGPT 2:4: at
every group of 4 columns drop the 2 weights of each row with the smallest w^2 / U_jj^2), and
its error e = (w - q) / U_jj is spread over the remaining columns (W[:, j:] -= e U[j, j:]).
Pruning and quantizing together quantizes the survivors with the same error feedback.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quant.grids import int4_codes, int4_dequant, int4_grid, mask_24


@dataclass
class SolverResult:
    """What the solver produced for one (N, K) weight."""

    weight: torch.Tensor  # (N, K) float32: the dequantized / pruned weight
    codes: torch.Tensor | None  # (N, K) float32 INT4 codes in [0, 15] (pruned positions: any value)
    scales: torch.Tensor | None  # (N, K/G) float32
    zeros: torch.Tensor | None  # (N, K/G) float32
    drop: torch.Tensor | None  # (N, K) bool, True = pruned


class HessianAccumulator:
    """Running H = 2 X X^T / n over every row of the inputs a linear sees (float32)."""

    def __init__(self, in_features: int, device: torch.device) -> None:
        self.H = torch.zeros(in_features, in_features, dtype=torch.float32, device=device)
        self.n = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).to(torch.float32)  # (n, K)
        m = x.shape[0]
        self.H *= self.n / (self.n + m)
        self.n += m
        x = x * (2 / self.n) ** 0.5
        self.H += x.T @ x


def _inverse_cholesky(H: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of (H + damp * mean(diag) I)^-1; damping grows 10x if H is singular."""
    mean_diag = torch.diag(H).mean()
    eye = torch.eye(H.shape[0], dtype=H.dtype, device=H.device)
    for attempt in range(4):
        L, info = torch.linalg.cholesky_ex(H + (damp * 10 ** attempt) * mean_diag * eye)
        if int(info) == 0:
            Hinv = torch.cholesky_inverse(L)
            U, info = torch.linalg.cholesky_ex(Hinv, upper=True)
            if int(info) == 0:
                return U
    raise ValueError(f"the calibration Hessian is not positive definite even with damp={damp * 1000:g}; "
                     "use more (or more varied) calibration samples")


def solve(weight: torch.Tensor, H: torch.Tensor, *, damp: float = 0.01, block_size: int = 128,
          group_size: int | None = None, sparse24: bool = False, act_order: bool = False,
          grid: str = "mse", zero_point: str = "float") -> SolverResult:
    """Quantize to INT4 (group_size set) and/or prune 2:4 (sparse24) one (N, K) weight with GPTQ feedback.

    `grid` picks each group's INT4 grid (quant.grids.int4_grid), from the group's weights as
    updated by the feedback so far when its first column is reached (static before any update
    with act_order). grid "hmse" is "mse" with each input's rounding error weighted by its
    diag(H) (the input's mean square), so a clip spares the weights that see the largest inputs.
    `zero_point` "integer" restricts every grid to an integer zero point (int4_grid), so the error
    feedback sees exactly the weights a compressed-tensors export stores.
    """
    if group_size is None and not sparse24:
        raise ValueError("solve() needs group_size (INT4), sparse24=True, or both")
    if act_order and sparse24:
        raise ValueError("act_order cannot be combined with 2:4 pruning (groups of 4 follow the input order)")
    base_grid = "mse" if grid == "hmse" else grid
    W = weight.to(torch.float32).clone()
    N, K = W.shape
    H = H.to(torch.float32).clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    perm = torch.argsort(torch.diag(H), descending=True) if act_order else None
    if group_size is not None:
        ngroups = K // group_size
        scales = torch.zeros(N, ngroups, device=W.device)
        zeros = torch.zeros(N, ngroups, device=W.device)
        if act_order:  # static groups: grids from the (unpermuted) weights before any update
            imp = torch.diag(H).view(ngroups, group_size) if grid == "hmse" else None
            scales, zeros = int4_grid(W.view(N, ngroups, group_size), base_grid, imp, zero_point)
        block_size = -(-max(block_size, group_size) // group_size) * group_size
    if perm is not None:
        W, H = W[:, perm], H[perm][:, perm]
    U = _inverse_cholesky(H, damp)
    codes = torch.zeros_like(W) if group_size is not None else None
    drop = torch.zeros_like(W, dtype=torch.bool) if sparse24 else None
    for i1 in range(0, K, block_size):
        i2 = min(i1 + block_size, K)
        W1 = W[:, i1:i2].clone()  # (N, b)
        Q1, E1 = torch.zeros_like(W1), torch.zeros_like(W1)
        U1 = U[i1:i2, i1:i2]
        d1 = torch.diag(U1)
        drop1 = None
        for i in range(i2 - i1):
            col = i1 + i
            w, d = W1[:, i], U1[i, i]
            if sparse24 and i % 4 == 0:
                drop1 = mask_24(W1[:, i:i + 4] ** 2 / d1[i:i + 4][None, :] ** 2)  # (N, 4)
                drop[:, col:col + 4] = drop1
            q = w
            if group_size is not None:
                orig = int(perm[col]) if perm is not None else col
                g = orig // group_size
                if perm is None and orig % group_size == 0:
                    imp = torch.diag(H)[col:col + group_size] if grid == "hmse" else None
                    scales[:, g], zeros[:, g] = int4_grid(W1[:, i:i + group_size], base_grid, imp, zero_point)
                c = int4_codes(w, scales[:, g], zeros[:, g])
                codes[:, col] = c
                q = int4_dequant(c, scales[:, g], zeros[:, g])
            if sparse24:
                q = torch.where(drop1[:, i % 4], torch.zeros_like(q), q)
            Q1[:, i] = q
            err = (w - q) / d
            W1[:, i:] -= err[:, None] * U1[i, i:][None, :]
            E1[:, i] = err
        W[:, i1:i2] = Q1
        W[:, i2:] -= E1 @ U[i1:i2, i2:]
    if perm is not None:
        inv = torch.argsort(perm)
        W = W[:, inv]
        codes = codes[:, inv] if codes is not None else None
    return SolverResult(W, codes, scales if group_size is not None else None,
                        zeros if group_size is not None else None, drop)
