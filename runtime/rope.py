"""Rotary position embeddings: cos/sin tables from the Hugging Face config (theta and scaling)."""

from __future__ import annotations

from typing import Any

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


def _inv_freq(hf_config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (D/2,) and the attention scaling the config's rope type asks for."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (theta ** exponent), 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope type {rope_type!r} is not supported (known: default, "
                         f"{', '.join(ROPE_INIT_FUNCTIONS)})")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


class Rope:
    """Precomputed cos/sin for positions [0, max_positions); indexed by a (B, T) position tensor."""

    def __init__(self, hf_config: Any, head_dim: int, max_positions: int,
                 device: torch.device | str = "cpu") -> None:
        inv_freq, scaling = _inv_freq(hf_config, head_dim)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # (P, D/2)
        emb = torch.cat([freqs, freqs], dim=-1)  # (P, D)
        self.cos = (emb.cos() * scaling).to(device)
        self.sin = (emb.sin() * scaling).to(device)

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for `positions` (B, T), each (B, 1, T, D) in `dtype`."""
        return rope_at(self.cos, self.sin, positions, dtype)


def rope_at(cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows `positions` (B, T) of the tables cos, sin (P, D) -> each (B, 1, T, D) in `dtype`."""
    return cos[positions][:, None].to(dtype), sin[positions][:, None].to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, H, T, D) by the half-split convention of Hugging Face Llama."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
