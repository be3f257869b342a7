"""Block-quantized linears (GGUF-style codes) on the CPU: the `blockq_mm` op, its paths, its reference.

The op is compiled into the runtime's C++ extension (`cpu_blockq.cpp`; `runtime.kernels.extension`
builds and loads it: `available()`, `unavailable_reason()`). It picks its path at run time from the
CPU's features: AMX-INT8 tiles for calls of `AMX_MIN_ROWS` rows or more, AVX-512 VNNI otherwise,
AVX2 + FMA on CPUs without AVX-512, plain C++ on other CPUs. The arithmetic (int8 activations in
blocks of 32, exact integer dot products per group, one float epilogue order) is the same on every
path, so a row's output does not depend on the path or the row count.

`blockq_mm_ref` is the same computation in PyTorch (float64 accumulation), what the kernel is
tested against. Without the extension `runtime.blockq` runs its dense fallback.
"""

from __future__ import annotations

import os
import re
import time

import torch

from runtime.kernels.extension import LANES, NAMESPACE, available, ops, unavailable_reason

__all__ = ["ACT_BLOCK", "AMX_MIN_ROWS", "ISAS", "ISA_ENV", "LANES", "NAMESPACE", "available", "blockq_mm",
           "blockq_mm_ref", "default_isa", "fast", "isas", "ops", "quantize_activations_ref", "read_bandwidth",
           "unavailable_reason"]

ACT_BLOCK = 32  # activations share one int8 scale per 32 inputs
# calls with at least this many rows take the AMX path where the CPU has it (one row: VNNI, which
# needs no tile set-up; the crossover benchmarks/qlinear_rows.py measures)
AMX_MIN_ROWS = 12
ISAS = {"auto": 0, "generic": 1, "vnni": 2, "amx": 3, "avx2": 4}
ISA_ENV = "SPECDEC_BLOCKQ_ISA"  # the path every call without its own `isa` takes (default: auto)


@torch.compiler.assume_constant_result
def default_isa() -> str:
    """The kernel path of calls that name none: $SPECDEC_BLOCKQ_ISA (auto, generic, vnni, amx, avx2;
    e.g. avx2 runs an AVX-512 CPU as an AVX2-only one would), else "auto" (by the CPU and row count).
    A constant to `torch.compile` (it asks the kernels which paths the CPU runs, which a graph cannot
    hold): a compiled step reads it when it is traced."""
    isa = os.environ.get(ISA_ENV, "auto").strip().lower() or "auto"
    if isa not in ISAS:
        raise ValueError(f"{ISA_ENV}={os.environ[ISA_ENV]!r} is not a kernel path; use one of {', '.join(ISAS)}")
    if isa not in ("auto", *isas()):
        raise ValueError(f"{ISA_ENV}={isa} asks for a kernel path this CPU does not run; it runs "
                         f"{', '.join(isas()) or 'none (the kernels are unavailable)'}")
    return isa


def fast() -> bool:
    """Whether the kernels run here with SIMD (AVX-512 VNNI, AMX or AVX2 + FMA, and $SPECDEC_BLOCKQ_ISA
    does not force the plain C++ path): the CPUs where a block-quantized model decodes faster than its
    dense copy. The plain C++ path is exact but slow."""
    return available() and bool({"vnni", "avx2"} & set(isas())) and default_isa() != "generic"


def isas() -> tuple[str, ...]:
    """The kernel paths this CPU runs: "generic" always, "vnni" (AVX-512 VNNI), "amx" (AMX-INT8),
    "avx2" (AVX2 + FMA)."""
    if not available():
        return ()
    mask = ops().blockq_isas()
    return tuple(name for name, bit in (("generic", 1), ("vnni", 2), ("amx", 4), ("avx2", 8)) if mask & bit)


def blockq_mm(x: torch.Tensor, codes: torch.Tensor, sc: torch.Tensor, mc: torch.Tensor, d: torch.Tensor,
              dm: torch.Tensor | None, bias: torch.Tensor | None, bits: int, group: int, super_block: int,
              zero: float = 0.0, isa: str | None = None, amx_min_rows: int = AMX_MIN_ROWS) -> torch.Tensor:
    """x (..., K) float32 / bf16 -> (..., N) in x's dtype through the compiled kernel (path `isa`,
    default `default_isa()`); dm None: dm = zero * d. A wrong type or device is a TypeError / ValueError
    naming the argument (the op's own checks name the rest)."""
    if not available():
        raise RuntimeError(f"the block-quantized CPU kernels are unavailable: {unavailable_reason()}")
    if isa is not None and (not isinstance(isa, str) or isa not in ISAS):
        raise ValueError(f"blockq_mm: isa must be one of {', '.join(ISAS)} (or None: {ISA_ENV}), got {isa!r}")
    path = ISAS[isa or default_isa()]
    if isinstance(x, torch.Tensor) and x.device.type == "cpu":  # the op reads every tensor's memory on the CPU
        for name, t in (("codes", codes), ("sc", sc), ("mc", mc), ("d", d), ("dm", dm), ("bias", bias)):
            if isinstance(t, torch.Tensor) and t.device.type != "cpu":
                raise ValueError(f"blockq_mm: {name} is on {t.device}; the CPU kernels take CPU tensors")
    try:
        return ops().blockq_mm(x, codes, sc, mc, d, dm, bias, bits, group, super_block, zero, path, amx_min_rows)
    except (RuntimeError, IndexError) as err:
        mapped = _argument_error(err, x)
        if mapped is None:
            raise
        raise mapped from err


def _argument_error(err: Exception, x) -> Exception | None:
    """The op's dispatcher error for an argument of the wrong type (or a 0-d x), as a TypeError /
    ValueError naming the argument; None for any other error (raised as it is)."""
    found = re.search(r"Expected a value of type '([^']+)' for argument '(\w+)' but instead found type '(\w+)'",
                      str(err))
    if found:
        want, name, got = found.groups()
        return TypeError(f"blockq_mm: {name} must be {want}" + (" (a 64-bit integer)" if want == "int" else "")
                         + f", got {got}" + (" out of range" if got == want else ""))
    if isinstance(x, torch.Tensor) and x.dim() == 0:
        return ValueError("blockq_mm: x must have at least one dimension (..., in_features), got a 0-d tensor")
    return None


def read_bandwidth(buf: torch.Tensor, repeats: int = 5) -> float:
    """Best read bandwidth (bytes/s) of `repeats` passes of `read_probe` over `buf` (all threads): the
    bound the benchmarks compare a decode step's weight reads with."""
    ops().read_probe(buf)
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        ops().read_probe(buf)
        best = max(best, buf.numel() * buf.element_size() / (time.perf_counter() - t))
    return best


def quantize_activations_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> int8 codes (M, K) and float32 scales (M, K/32), as the kernel rounds them:
    scale = max|x| / 127 per block of 32, codes = nearest-even(x * 127 / max|x|)."""
    M, K = x.shape
    if K % ACT_BLOCK:
        raise ValueError(f"quantize_activations_ref: in_features must be a multiple of {ACT_BLOCK}, got {K}")
    xb = x.float().view(M, K // ACT_BLOCK, ACT_BLOCK)
    amax = xb.abs().amax(-1)  # (M, K/32)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(xb * inv[..., None]).to(torch.int8).view(M, K)
    return q, amax / 127.0


def blockq_mm_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's result computed in float64: x's rows quantized as the kernel does, times the
    exact float32 weight (N, K) (`BlockQuantLinear.dequantize()`); returns float64 (..., N)."""
    x2 = x.reshape(-1, x.shape[-1])
    q, scale = quantize_activations_ref(x2)
    xd = (q.double().view(q.shape[0], q.shape[1] // ACT_BLOCK, ACT_BLOCK) * scale.double()[..., None]).view_as(q)
    y = xd @ weight.double().t()
    if bias is not None:
        y = y + bias.double()
    return y.view(*x.shape[:-1], weight.shape[0])
