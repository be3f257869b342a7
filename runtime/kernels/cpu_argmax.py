"""The greedy token choice on the CPU: `argmax`, torch.argmax(x, -1) through the runtime's C++
extension (`cpu_argmax.cpp`) for float32 and bfloat16 rows.

torch.argmax over a bfloat16 row of a 151,936-token vocabulary takes ~480 us on the CPU (~2% of a
4-bit 1.5B decode step, ~7% of an 8-row verification); the extension's pass takes ~10-20 us. It
returns the same index: the first index of the row's maximum, or of its first NaN.
"""

from __future__ import annotations

import torch

from runtime.kernels.extension import available, ops

__all__ = ["ARGMAX_PATHS", "argmax"]

ARGMAX_PATHS = {"generic": 0, "avx2": 1, "avx512": 2}  # the op's `isa` argument (-1: the CPU's best)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, -1) (x (..., V) -> (...) int64), through the extension for float32 and bfloat16
    CPU tensors when it is available, else torch's own."""
    if (x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and x.dim() >= 1
            and x.shape[-1] > 0 and available()):
        return ops().argmax_rows(x)
    return x.argmax(-1)
