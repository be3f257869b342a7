"""Quantized and sparse linear layers used online: INT8, INT4 (group-wise), NF4, LLM.int8, 2:4 (+INT4).

Each module keeps its packed storage as buffers, has the forward of `nn.Linear`
(x (..., in) -> (..., out)), and offers `dequantize(dtype)` (the dense reference it must
match), `to_tensors()` / `from_tensors(tensors, meta)` (the exact tensors a compressed
checkpoint stores) and `meta()` (the JSON-ready shape description). `quant` builds them
offline; `runtime.compressed` rebuilds them from a checkpoint without re-quantizing.

Execution paths, chosen by measurement on the 2-core CPU this project targets (one thread,
bf16 activations, a 9728x896 weight): bf16 `F.linear` 1.09 ms per token row,
`_weight_int8pack_mm` 0.53 ms, `_weight_int4pack_mm_for_cpu` 0.43 ms. The packed kernels cost
~0.11 ms per further row (2 threads: 40 rows 4.5 ms, 512 rows 56-61 ms), while the dense path
must first dequantize the whole weight (2 threads: 55 ms for INT4, 33 ms for INT8, before its
1 ms matmul). So calls of up to `PACKED_MAX_ROWS` rows (decode steps, verification blocks and
prompts of ordinary length) use the packed kernels (INT4: when out_features is a multiple of
16), and only longer ones (long prompts, perplexity windows) dequantize. A lower limit sends
ordinary prompts down the dequantizing path: at 8 rows a 40-token prompt costs the INT4 0.5B
~1.8 s (docs/experiments/2026-11-22-quantized-drafts.md).
"""

from __future__ import annotations

import abc
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# Above this many rows per call the packed CPU kernels lose to dequantize + dense matmul
# (measured crossover: ~300 rows for INT8, ~500 for INT4).
PACKED_MAX_ROWS = 256
_INT8_KERNEL_ALIGN = 16  # bytes `_weight_int8pack_mm` needs (measured: offsets 1, 4, 8 crash, 16 and 32 run)


# With a dense copy (keep_dense_for_prompts), calls of this many tokens per row use it: more
# than a decode step or a verification block of k <= 14 drafts, which keep the packed kernels.
DENSE_COPY_MIN_TOKENS = 16


def keep_dense_for_prompts(model: nn.Module, dtype: torch.dtype) -> int:
    """Give the quantized linears of `model` a dense `dtype` copy of their weight, used for calls
    of DENSE_COPY_MIN_TOKENS tokens per row or more (prompts); returns the bytes added.

    A speed-for-memory trade for a quantized draft on the CPU: the packed kernels cost per row
    (INT4, 2 threads, a 9728x896 weight: 4.3 ms for 40 rows, 21.5 ms for 200) where a bf16
    matmul costs 1.0 / 2.4 ms, so without the copy a draft's prompt prefill takes longer than the
    bf16 target's (docs/experiments/2026-11-22-quantized-drafts.md).
    Decode steps keep the packed kernels. 2:4 layers are skipped (on the CPU they already run
    dense). Not for a target whose outputs must equal its plain decoding exactly: its long
    verification blocks would take the dense path and plain decoding the packed one. Call it
    before `runtime.compile_decode`.
    """
    if getattr(model, "compiled", False):
        raise ValueError("keep_dense_for_prompts before runtime.compile_decode: compiled programs "
                         "hold the weights as they were")
    added = 0
    for module in model.modules():
        if isinstance(module, QuantizedLinear) and not isinstance(module, Sparse24Linear):
            module.prompt_weight = module.dequantize(dtype).contiguous()  # (out, in)
            added += module.prompt_weight.numel() * module.prompt_weight.element_size()
    return added


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1]


class QuantizedLinear(nn.Module, abc.ABC):
    """Common part: sizes, optional bias, the dense fallback and the tensor/meta protocol."""

    FORMAT = ""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        # (out, in) dense copy for prompts, see keep_dense_for_prompts; a buffer so that it moves
        # with the module, not persistent: checkpoints store the packed format only
        self.register_buffer("prompt_weight", None, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., T, in) -> (..., T, out): the format's own path, or the dense copy for calls of
        DENSE_COPY_MIN_TOKENS tokens per row or more when `keep_dense_for_prompts` made one."""
        if (self.prompt_weight is not None and x.dim() >= 2 and x.shape[-2] >= DENSE_COPY_MIN_TOKENS
                and self.prompt_weight.dtype == x.dtype):
            return F.linear(x, self.prompt_weight, self._bias(x))
        return self._forward(x)

    @abc.abstractmethod
    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        """The format's own matmul."""

    @abc.abstractmethod
    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense (out, in) weight this module represents."""

    @abc.abstractmethod
    def storage(self) -> dict[str, torch.Tensor]:
        """The packed tensors (without the bias)."""

    def meta(self) -> dict[str, Any]:
        """JSON-ready description: format, sizes and format parameters."""
        return {"format": self.FORMAT, "in_features": self.in_features,
                "out_features": self.out_features, "bias": self.bias is not None}

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """Everything a checkpoint stores for this module, by local name."""
        out = dict(self.storage())
        if self.bias is not None:
            out["bias"] = self.bias.data
        return out

    def nbytes(self) -> int:
        """Bytes of the stored tensors (what the weight costs in memory and on disk)."""
        return sum(t.numel() * t.element_size() for t in self.to_tensors().values())

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantize(x.dtype), self._bias(x))

    def _bias(self, x: torch.Tensor) -> torch.Tensor | None:
        return None if self.bias is None else self.bias.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.FORMAT}"


class Int8Linear(QuantizedLinear):
    """Per-output-channel symmetric INT8 weights: w = qweight * scales[:, None]."""

    FORMAT = "int8"

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        if qweight.dtype != torch.int8 or scales.shape != (qweight.shape[0],):
            raise ValueError(f"Int8Linear needs int8 (out, in) weights and (out,) scales, got "
                             f"{qweight.dtype} {tuple(qweight.shape)} and {tuple(scales.shape)}")
        super().__init__(qweight.shape[1], qweight.shape[0], bias)
        if qweight.data_ptr() % _INT8_KERNEL_ALIGN:
            # `_weight_int8pack_mm` crashes (SIGSEGV) on unaligned weights once a call has 4 or more
            # rows; tensors read from a safetensors file sit at the file's offsets, and a clone gets
            # the allocator's 64-byte alignment
            qweight = qweight.clone()
        self.register_buffer("qweight", qweight)  # (N, K) int8
        self.register_buffer("scales", scales)  # (N,)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.qweight.to(torch.float32) * self.scales.to(torch.float32)[:, None]).to(dtype)

    def storage(self) -> dict[str, torch.Tensor]:
        return {"qweight": self.qweight, "scales": self.scales}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> "Int8Linear":
        return cls(tensors["qweight"], tensors["scales"], tensors.get("bias"))

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and _rows(x) <= PACKED_MAX_ROWS:
            x2 = x.reshape(-1, self.in_features).contiguous()
            y = torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scales.to(x.dtype))
            y = y.view(*x.shape[:-1], self.out_features)
            return y if self.bias is None else y + self._bias(x)
        if x.device.type == "cuda":
            # (x @ q^T) * s: the int8 weight is converted tile by tile inside the matmul
            y = F.linear(x, self.qweight.to(x.dtype)) * self.scales.to(x.dtype)
            return y if self.bias is None else y + self._bias(x)
        return self._dense(x)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """(N, K) integer codes in [0, 15] -> (N, K/2) uint8, even column in the low nibble."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_int4`: (N, K/2) uint8 -> (N, K) int32 codes."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2).to(torch.int32)  # (N, K)


class Int4Linear(QuantizedLinear):
    """Group-wise asymmetric INT4: w[n, k] = (q[n, k] - 8) * scales[n, g] + zeros[n, g], g = k // G.

    This is the convention of PyTorch's `_weight_int4pack_mm*` ops (zero = min + 8 * scale),
    so the scales and zeros feed the kernels unchanged. Storage: two codes per byte.
    """

    FORMAT = "int4"

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None = None) -> None:
        out_features, half = qweight.shape
        in_features = 2 * half
        if qweight.dtype != torch.uint8 or in_features % group_size:
            raise ValueError(f"Int4Linear needs uint8 (out, in/2) codes with in divisible by group_size "
                             f"{group_size}, got {qweight.dtype} {tuple(qweight.shape)}")
        groups = (out_features, in_features // group_size)
        if scales.shape != groups or zeros.shape != groups:
            raise ValueError(f"Int4Linear scales/zeros must be {groups}, got {tuple(scales.shape)} and "
                             f"{tuple(zeros.shape)}")
        super().__init__(in_features, out_features, bias)
        self.group_size = group_size
        self.register_buffer("qweight", qweight)  # (N, K/2) uint8
        self.register_buffer("scales", scales)  # (N, K/G)
        self.register_buffer("zeros", zeros)  # (N, K/G)
        self._kernel: tuple[torch.device, torch.Tensor] | None = None
        self._sz: tuple[tuple[torch.device, torch.dtype], torch.Tensor] | None = None

    def codes(self) -> torch.Tensor:
        return unpack_int4(self.qweight)  # (N, K) int32

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        q = self.codes().to(torch.float32).view(self.out_features, -1, self.group_size)  # (N, K/G, G)
        s = self.scales.to(torch.float32)[..., None]
        z = self.zeros.to(torch.float32)[..., None]
        return ((q - 8) * s + z).view(self.out_features, self.in_features).to(dtype)

    def storage(self) -> dict[str, torch.Tensor]:
        return {"qweight": self.qweight, "scales": self.scales, "zeros": self.zeros}

    def meta(self) -> dict[str, Any]:
        return {**super().meta(), "group_size": self.group_size}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> "Int4Linear":
        return cls(tensors["qweight"], tensors["scales"], tensors["zeros"], int(meta["group_size"]),
                   tensors.get("bias"))

    def _packed_for_kernel(self, device: torch.device) -> torch.Tensor:
        if self._kernel is None or self._kernel[0] != device:
            if device.type == "cpu":
                packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(self.codes(), 1)
            else:
                q = self.codes()
                packed = torch.ops.aten._convert_weight_to_int4pack(
                    ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8), 8)
            self._kernel = (device, packed)
        return self._kernel[1]

    def _scales_and_zeros(self, dtype: torch.dtype) -> torch.Tensor:
        """(K/G, N, 2) kernel layout, built once per device and dtype (rebuilding it costs as much as the matmul)."""
        key = (self.scales.device, dtype)
        if self._sz is None or self._sz[0] != key:
            sz = torch.stack([self.scales, self.zeros], dim=-1).transpose(0, 1).contiguous().to(dtype)
            self._sz = (key, sz)
        return self._sz[1]

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        cpu_ok = x.device.type == "cpu" and self.out_features % 16 == 0 and _rows(x) <= PACKED_MAX_ROWS
        cuda_ok = (x.device.type == "cuda" and x.dtype == torch.bfloat16 and self.out_features % 8 == 0
                   and self.in_features % (self.group_size * 8) == 0)
        if not (cpu_ok or cuda_ok):
            return self._dense(x)
        x2 = x.reshape(-1, self.in_features).contiguous()
        packed, sz = self._packed_for_kernel(x.device), self._scales_and_zeros(x.dtype)
        if cpu_ok:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, packed, self.group_size, sz)
        else:
            y = torch.ops.aten._weight_int4pack_mm(x2, packed, self.group_size, sz)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self._bias(x)


def pack_24_indices(idx: torch.Tensor) -> torch.Tensor:
    """(N, K/4, 2) positions in [0, 3] of the kept weights of each group -> (N, K/8) uint8."""
    nib = (idx[..., 0] | (idx[..., 1] << 2)).to(torch.uint8)  # (N, K/4): 4 bits per group
    return nib[:, 0::2] | (nib[:, 1::2] << 4)


def unpack_24_indices(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_24_indices`: (N, K/8) uint8 -> (N, K/4, 2) int64."""
    nib = torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)  # (N, K/4)
    return torch.stack([nib & 0x3, (nib >> 2) & 0x3], dim=-1).to(torch.int64)


class Sparse24Linear(QuantizedLinear):
    """2:4 semi-structured sparse weights: 2 kept values of every 4 inputs plus their 2-bit positions.

    Storage: values (N, K/2) in 16-bit and indices (N, K/8) uint8. CUDA runs
    `to_sparse_semi_structured` kernels; the CPU has no faster 2:4 kernel than a dense
    matmul, so it multiplies by the masked dense weight (built once per device and dtype).
    """

    FORMAT = "sparse24"

    def __init__(self, values: torch.Tensor, indices: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        out_features, half = values.shape
        if half % 2 or indices.dtype != torch.uint8 or indices.shape != (out_features, half // 4):
            raise ValueError(f"Sparse24Linear needs (out, in/2) values and (out, in/8) uint8 indices, got "
                             f"{tuple(values.shape)} and {indices.dtype} {tuple(indices.shape)}")
        super().__init__(2 * half, out_features, bias)
        self.register_buffer("values", values)  # (N, K/2)
        self.register_buffer("indices", indices)  # (N, K/8) uint8
        self._weight: tuple[torch.device, torch.dtype, torch.Tensor] | None = None

    @classmethod
    def from_dense(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "Sparse24Linear":
        """Compress a dense (out, in) weight that already has at most 2 nonzeros in every 4 inputs."""
        N, K = weight.shape
        if K % 8:
            raise ValueError(f"2:4 sparsity needs in_features divisible by 8, got {K}")
        groups = weight.view(N, K // 4, 4)
        nonzero = groups != 0
        if (nonzero.sum(-1) > 2).any():
            raise ValueError("weight is not 2:4 sparse: some group of 4 inputs has more than 2 nonzeros")
        # keep the nonzeros first (stable), padding with zero positions when a group has fewer
        order = torch.sort((~nonzero).to(torch.int8), dim=-1, stable=True).indices[..., :2]  # (N, K/4, 2)
        idx = torch.sort(order, dim=-1).values
        values = groups.gather(-1, idx).reshape(N, K // 2)
        return cls(values, pack_24_indices(idx), bias)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        N, K = self.out_features, self.in_features
        idx = unpack_24_indices(self.indices)  # (N, K/4, 2)
        dense = torch.zeros(N, K // 4, 4, dtype=dtype, device=self.values.device)
        dense.scatter_(-1, idx, self.values.view(N, K // 4, 2).to(dtype))
        return dense.view(N, K)

    def storage(self) -> dict[str, torch.Tensor]:
        return {"values": self.values, "indices": self.indices}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> "Sparse24Linear":
        return cls(tensors["values"], tensors["indices"], tensors.get("bias"))

    def _weight_for(self, x: torch.Tensor) -> torch.Tensor:
        if self._weight is None or self._weight[:2] != (x.device, x.dtype):
            weight = self.dequantize(x.dtype)
            if x.device.type == "cuda" and x.dtype in (torch.float16, torch.bfloat16) and \
                    self.out_features % 64 == 0 and self.in_features % 64 == 0:
                from torch.sparse import to_sparse_semi_structured

                weight = to_sparse_semi_structured(weight)
            self._weight = (x.device, x.dtype, weight)
        return self._weight[2]

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self._weight_for(x)
        if weight.layout == torch.strided or x.device.type != "cuda":
            return F.linear(x, weight, self._bias(x))
        x2 = x.reshape(-1, self.in_features)
        pad = -x2.shape[0] % 8  # the sparse kernels need the dense operand in multiples of 8 rows
        y = F.linear(F.pad(x2, (0, 0, 0, pad)), weight)[: x2.shape[0]]
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self._bias(x)


class Sparse24Int4Linear(Sparse24Linear):
    """2:4 sparse weights whose kept values are INT4 codes (two per byte) on a per-group grid.

    Kept value j of a row came from inputs 4 * (j // 2) .. + 3, so it belongs to input group
    (4 * (j // 2)) // G = j // (G / 2): value = (code - 8) * scales[n, g] + zeros[n, g].
    Storage: codes (N, K/4) uint8, indices (N, K/8) uint8, scales / zeros (N, K/G).
    """

    FORMAT = "sparse24_int4"

    def __init__(self, codes: torch.Tensor, indices: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int, bias: torch.Tensor | None = None) -> None:
        out_features, quarter = codes.shape
        in_features = 4 * quarter
        if codes.dtype != torch.uint8 or group_size % 4 or in_features % group_size:
            raise ValueError(f"Sparse24Int4Linear needs uint8 (out, in/4) codes and a group size that is a "
                             f"multiple of 4 dividing in={in_features}, got {codes.dtype} and {group_size}")
        groups = (out_features, in_features // group_size)
        if scales.shape != groups or zeros.shape != groups:
            raise ValueError(f"Sparse24Int4Linear scales/zeros must be {groups}")
        values = torch.empty(out_features, in_features // 2, dtype=scales.dtype, device=codes.device)
        super().__init__(values, indices, bias)
        del self.values
        self.group_size = group_size
        self.register_buffer("codes", codes)  # (N, K/4) uint8
        self.register_buffer("scales", scales)  # (N, K/G)
        self.register_buffer("zeros", zeros)  # (N, K/G)

    def kept_values(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(N, K/2) dequantized kept values."""
        q = unpack_int4(self.codes).to(torch.float32)  # (N, K/2)
        g = torch.arange(q.shape[1], device=q.device) // (self.group_size // 2)
        s, z = self.scales.to(torch.float32)[:, g], self.zeros.to(torch.float32)[:, g]
        return ((q - 8) * s + z).to(dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        N, K = self.out_features, self.in_features
        idx = unpack_24_indices(self.indices)  # (N, K/4, 2)
        dense = torch.zeros(N, K // 4, 4, dtype=dtype, device=self.codes.device)
        dense.scatter_(-1, idx, self.kept_values(dtype).view(N, K // 4, 2))
        return dense.view(N, K)

    def storage(self) -> dict[str, torch.Tensor]:
        return {"codes": self.codes, "indices": self.indices, "scales": self.scales, "zeros": self.zeros}

    def meta(self) -> dict[str, Any]:
        return {**super().meta(), "group_size": self.group_size}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> "Sparse24Int4Linear":
        return cls(tensors["codes"], tensors["indices"], tensors["scales"], tensors["zeros"],
                   int(meta["group_size"]), tensors.get("bias"))


class NF4Linear(QuantizedLinear):
    """bitsandbytes 4-bit NormalFloat weights (blocks of `blocksize`, optional double quantization)."""

    FORMAT = "nf4"

    def __init__(self, in_features: int, out_features: int, state: dict[str, torch.Tensor],
                 bias: torch.Tensor | None = None) -> None:
        super().__init__(in_features, out_features, bias)
        self._keys = sorted(state)
        for key in self._keys:
            self.register_buffer(_buffer_name(key), state[key])
        self._quant_state: tuple[torch.device, Any] | None = None

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None, blocksize: int,
                 double_quant: bool) -> "NF4Linear":
        import bitsandbytes.functional as bnbf

        packed, qs = bnbf.quantize_4bit(weight, blocksize=blocksize, quant_type="nf4",
                                        compress_statistics=double_quant)
        state = {"qweight": packed, **qs.as_dict(packed=True)}
        return cls(weight.shape[1], weight.shape[0], state, bias)

    def _state(self):
        import bitsandbytes.functional as bnbf

        device = self.qweight.device
        if self._quant_state is None or self._quant_state[0] != device:
            parts = {k: getattr(self, _buffer_name(k)) for k in self._keys if k != "qweight"}
            self._quant_state = (device, bnbf.QuantState.from_dict(parts, device))
        return self._quant_state[1]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        import bitsandbytes.functional as bnbf

        return bnbf.dequantize_4bit(self.qweight, self._state()).to(dtype)

    def storage(self) -> dict[str, torch.Tensor]:
        return {k: getattr(self, _buffer_name(k)) for k in self._keys}

    def meta(self) -> dict[str, Any]:
        return {**super().meta(), "blocksize": int(self._state().blocksize)}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> "NF4Linear":
        state = {k: v for k, v in tensors.items() if k != "bias"}
        return cls(int(meta["in_features"]), int(meta["out_features"]), state, tensors.get("bias"))

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        import bitsandbytes as bnb

        state = self._state()
        if state.dtype != x.dtype:
            return self._dense(x)
        return bnb.matmul_4bit(x, self.qweight.t(), quant_state=state, bias=self._bias(x))


def _buffer_name(key: str) -> str:
    return key.replace(".", "__")


class Int8MixedLinear(QuantizedLinear):
    """LLM.int8 (bitsandbytes): INT8 row-wise weights; input columns with |x| >= threshold stay 16-bit."""

    FORMAT = "int8_mixed"

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, threshold: float,
                 bias: torch.Tensor | None = None) -> None:
        if qweight.dtype != torch.int8 or scales.shape != (qweight.shape[0],):
            raise ValueError("Int8MixedLinear needs int8 (out, in) weights and (out,) float32 scales")
        super().__init__(qweight.shape[1], qweight.shape[0], bias)
        self.threshold = float(threshold)
        self.register_buffer("qweight", qweight)  # (N, K) int8, bitsandbytes CB
        self.register_buffer("scales", scales)  # (N,) float32 absmax per row, bitsandbytes SCB

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None, threshold: float) -> "Int8MixedLinear":
        import bitsandbytes.functional as bnbf

        qweight, scales, _ = bnbf.int8_vectorwise_quant(weight.to(torch.float16))
        return cls(qweight, scales.to(torch.float32), threshold, bias)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.qweight.to(torch.float32) * (self.scales[:, None] / 127.0)).to(dtype)

    def storage(self) -> dict[str, torch.Tensor]:
        return {"qweight": self.qweight, "scales": self.scales}

    def meta(self) -> dict[str, Any]:
        return {**super().meta(), "threshold": self.threshold}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> "Int8MixedLinear":
        return cls(tensors["qweight"], tensors["scales"], float(meta["threshold"]), tensors.get("bias"))

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        import bitsandbytes as bnb

        state = bnb.MatmulLtState()
        state.CB, state.SCB, state.threshold = self.qweight, self.scales, self.threshold
        state.has_fp16_weights, state.is_training = False, False
        # bitsandbytes computes LLM.int8 in float16 (it would cast, with a warning per call)
        bias = None if self.bias is None else self.bias.to(torch.float16)
        return bnb.matmul(x.to(torch.float16), self.qweight, state=state, bias=bias).to(x.dtype)


FORMATS: dict[str, type[QuantizedLinear]] = {
    cls.FORMAT: cls for cls in (Int8Linear, Int4Linear, Sparse24Linear, Sparse24Int4Linear, NF4Linear,
                                 Int8MixedLinear)}


def from_tensors(meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> QuantizedLinear:
    """Rebuild a module from its checkpoint tensors and `meta()` dictionary."""
    fmt = meta.get("format")
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantized-linear format {fmt!r}; known: {', '.join(FORMATS)}")
    return FORMATS[fmt].from_tensors(tensors, meta)
