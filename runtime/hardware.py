"""Devices: whether one exists here (`check_device`), and which floating-point type it multiplies
fast: bf16 where it is native, float32 elsewhere.

bf16 halves the bytes a decoding step reads, but only hardware with bf16 arithmetic (CUDA GPUs
of compute capability 8.0+, CPUs with AVX-512 BF16 or AMX, which oneDNN reports) computes with
it directly. An AVX2-only CPU (many AMD EPYC and older Intel parts) widens every bf16 operand
to float32 inside each product, and that conversion, not memory, sets the speed: there a single
row still decodes faster in bf16, but batched work (self-distillation, head training, batched
evaluation) runs several times faster in float32.
"""

from __future__ import annotations

import os

import torch

# the --dtype names every command accepts (some restrict them further), and their torch types
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def native_bf16(device: torch.device | str = "cpu") -> bool:
    """True where bf16 matrix products run natively on `device` (not widened to float32)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return True


# the CPU flags that decide which dtype and kernels are fast (written next to every figure)
SPEED_FLAGS = ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2")


def cpu_summary() -> dict:
    """The CPU's model name, core count and its SPEED_FLAGS present (Linux /proc/cpuinfo; model
    "unknown" and no flags elsewhere)."""
    model, flags = "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model == "unknown":
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return {"model": model, "cores": os.cpu_count(), "flags": [f for f in SPEED_FLAGS if f in flags],
            "native_bf16": native_bf16("cpu")}


def batch_dtype(device: torch.device | str = "cpu") -> torch.dtype:
    """The dtype for batched (compute-bound) work on `device`: bf16 where native, else float32."""
    return torch.bfloat16 if native_bf16(device) else torch.float32


def check_device(device: torch.device | str) -> torch.device:
    """`device` as a torch.device, or ValueError saying why the runtime cannot use it: a name torch
    does not know ('banana'), a CUDA device on a machine without one (or past its GPU count), or
    another device type this machine does not have."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"unknown device {str(device)!r}; use cpu, cuda or cuda:N") from err
    if dev.type == "cpu":
        return dev
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {str(device)!r} was asked for, but no CUDA GPU is available; use --device cpu")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise ValueError(f"device {str(device)!r} does not exist: this machine has {count} CUDA GPU(s), "
                             f"cuda:0 to cuda:{count - 1}")
        return dev
    backend = getattr(torch, dev.type, None)
    if not (callable(getattr(backend, "is_available", None)) and backend.is_available()):
        raise ValueError(f"device {str(device)!r} was asked for, but no {dev.type} device is available; use "
                         "--device cpu")
    return dev
