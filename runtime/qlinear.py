"""Quantized and sparse linear layers used online: INT8, INT4 (group-wise), NF4, LLM.int8, 2:4 (+INT4).

Each module keeps its packed storage as buffers, has the forward of `nn.Linear`
(x (..., in) -> (..., out)), and offers `dequantize(dtype)` (the dense reference it must
match), `to_tensors()` / `from_tensors(tensors, meta)` (the exact tensors a compressed
checkpoint stores) and `meta()` (the JSON-ready shape description). `quant` builds them
offline; `runtime.compressed` rebuilds them from a checkpoint without re-quantizing.

Kernel choice on the CPU, by row count and dtype (INT8 and INT4; `packed_max_rows`):

- few rows (decode steps, verification blocks) in bf16: PyTorch's packed weight-only kernels
  (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`). They read the weight once per call,
  but their cost grows with every row;
- many rows (prompts, perplexity windows, long trees), and every float32 call: `_tiled`, which
  dequantizes a tile of output channels at a time into a scratch buffer of about `TILE_BYTES` and
  calls the dense GEMM on it, in the activations' own dtype where the CPU multiplies it natively;
  on a CPU without native bf16 (AVX2 only) a bf16 call multiplies in float32 and rounds the result
  to bf16, because bf16 products there are widened in software.
  The packed kernels' float32 path is much slower than their bf16 one, and float32 calls must
  stay exact (outputs equal to the dequantized model's, for quality tables and losslessness
  checks), so float32 always takes `_tiled`.

No dense copy of the weight outlives a call. The crossover rows per (format, dtype) are in
`PACKED_MAX_ROWS`, measured with `benchmarks/quant_rows.py`. 2:4 formats run a masked dense
weight on the CPU (there is no faster CPU 2:4 kernel); NF4 and LLM.int8 run bitsandbytes.
"""

from __future__ import annotations

import abc
import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.sparse import to_sparse_semi_structured

from runtime.hardware import native_bf16

# Calls with more rows than this run `_tiled` (dequantize + dense GEMM); fewer run the packed
# kernel (the crossovers `benchmarks/quant_rows.py` measures).
PACKED_MAX_ROWS: dict[tuple[str, torch.dtype], int] = {
    ("int8", torch.bfloat16): 24, ("int4", torch.bfloat16): 96,
}
# Scratch per tile of `_tiled`: a few MB, so the dequantized tile is still in cache when the GEMM
# reads it, and enough output channels per tile that the GEMM runs at full speed.
TILE_BYTES = 4 << 20
_INT8_KERNEL_ALIGN = 16  # bytes `_weight_int8pack_mm` needs (measured: offsets 1, 4, 8 crash, 16 and 32 run)


def packed_max_rows(fmt: str, dtype: torch.dtype) -> int:
    """Most rows per call that still take the packed CPU kernel of format `fmt` in `dtype` (0: none,
    as for float32)."""
    return PACKED_MAX_ROWS.get((fmt, dtype), 0)


@functools.cache
def _widen_bf16() -> bool:
    """True on a CPU that widens bf16 products in software: `_tiled` multiplies bf16 calls in float32."""
    return not native_bf16("cpu")


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1]


class QuantizedLinear(nn.Module, abc.ABC):
    """Common part: sizes, optional bias, the tiled dense path and the tensor/meta protocol."""

    FORMAT = ""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., T, in) -> (..., T, out)."""
        return self._forward(x)

    def _apply(self, fn, recurse: bool = True):
        """`nn.Module._apply` (what `.to()`, `.cuda()`, `.bfloat16()` run) that moves this module's
        tensors between devices but keeps their dtypes: the codes, scales and bias are stored in the
        dtypes the format's kernels read (a 4-bit model's `.to(torch.bfloat16)` made the block kernels
        refuse bf16 scales, and rounded float16 scales). Activations take the dtype of the input."""

        def keep_dtype(t: torch.Tensor) -> torch.Tensor:
            out = fn(t)
            return out if out.dtype == t.dtype else t.to(device=out.device)

        return super()._apply(keep_dtype, recurse)

    @abc.abstractmethod
    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        """The format's own matmul."""

    @abc.abstractmethod
    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense (out, in) weight this module represents."""

    def dequantize_rows(self, start: int, stop: int, out: torch.Tensor) -> torch.Tensor:
        """Write output channels [start, stop) of the dense weight into `out` (stop - start, in)
        and return it. Formats with a fast slice override this."""
        return out.copy_(self.dequantize(out.dtype)[start:stop])

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

    def _packed_cpu(self, x: torch.Tensor) -> bool:
        """Whether a CPU call on x takes the packed kernel (few rows) rather than `_tiled`.

        Compiled programs (`runtime.compile_decode`: steps of a few tokens per row) keep the packed
        kernel at every row count: Inductor would fold a dequantized tile into a dense constant,
        a dense copy of the weight per program."""
        return torch.compiler.is_compiling() or _rows(x) <= packed_max_rows(self.FORMAT, x.dtype)

    def _tiled(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) @ W^T with W dequantized `tile` output channels at a time into one scratch
        buffer: the dense GEMM's speed without a dense copy of W (a CPU without native bf16 runs a
        bf16 call in float32: see the module docstring)."""
        if x.dtype == torch.bfloat16 and x.device.type == "cpu" and _widen_bf16():
            return self._tiled(x.float()).to(torch.bfloat16)
        N = self.out_features
        x2 = self._tile_inputs(x.reshape(-1, self.in_features))  # (M, K')
        K = x2.shape[1]
        align = self._tile_align()
        tile = max(align, min(N, TILE_BYTES // (K * x.element_size())) // align * align)
        scratch = torch.empty(tile * K, dtype=x.dtype, device=x.device)
        # bf16: each tile's GEMM writes its column block of y (M, N) in place; float32: its row block
        # of y^T (N, M), transposed once at the end (the faster layout for each dtype)
        rows_out = x.dtype == torch.float32
        y = torch.empty((N, x2.shape[0]) if rows_out else (x2.shape[0], N), dtype=x.dtype, device=x.device)
        for start in range(0, N, tile):
            stop = min(N, start + tile)
            w = self._tile_weight(start, stop, scratch[:(stop - start) * K].view(stop - start, K))
            if rows_out:
                torch.mm(w, x2.t(), out=y[start:stop])
            else:
                torch.mm(x2, w.t(), out=y[:, start:stop])
        y = (y.t() if rows_out else y).reshape(*x.shape[:-1], N)
        return y if self.bias is None else y + self._bias(x)

    def _tile_align(self) -> int:
        """Output channels per tile are a multiple of this (the format's storage blocks)."""
        return 1

    def _tile_inputs(self, x2: torch.Tensor) -> torch.Tensor:
        """The (M, K') left operand of `_tiled`'s GEMMs for activations x2 (M, K): x2 itself, unless
        the format appends columns that its `_tile_weight` rows multiply."""
        return x2

    def _tile_weight(self, start: int, stop: int, out: torch.Tensor) -> torch.Tensor:
        """The (stop - start, K') right operand of `_tiled` for output channels [start, stop): the
        dense rows, or what matches the format's `_tile_inputs`; `out` is a (stop - start, K') view
        of the scratch, and the result may be that scratch filled as a transposed (K', t) matrix."""
        return self.dequantize_rows(start, stop, out)

    def _packed(self, x: torch.Tensor, kernel) -> torch.Tensor:
        """Run `kernel(x2 (M, K)) -> (M, N)`, then restore x's shape and add the bias."""
        y = kernel(x.reshape(-1, self.in_features).contiguous()).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self._bias(x)

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantize(x.dtype), self._bias(x))

    def _bias(self, x: torch.Tensor) -> torch.Tensor | None:
        return None if self.bias is None else self.bias.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.FORMAT}"


class Int8Linear(QuantizedLinear):
    """Per-output-channel symmetric INT8 weights: w = qweight * scales[:, None]."""

    FORMAT = "int8"
    ROW_COST = True  # the packed kernel's time grows with the rows (runtime.compile.static_tokens)

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

    def dequantize_rows(self, start: int, stop: int, out: torch.Tensor) -> torch.Tensor:
        out.copy_(self.qweight[start:stop])
        return out.mul_(self.scales[start:stop, None].to(out.dtype))

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cuda":
            # (x @ q^T) * s: the int8 weight is converted tile by tile inside the matmul
            y = F.linear(x, self.qweight.to(x.dtype)) * self.scales.to(x.dtype)
            return y if self.bias is None else y + self._bias(x)
        if x.device.type != "cpu":
            return self._dense(x)
        return self.packed_kernel(x) if self._packed_cpu(x) else self._tiled(x)

    def packed_kernel(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) -> (..., out) through `_weight_int8pack_mm` on the CPU, whatever the rows."""
        return self._packed(x, lambda x2: torch.ops.aten._weight_int8pack_mm(x2, self.qweight,
                                                                             self.scales.to(x2.dtype)))


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """(N, K) integer codes in [0, 15] -> (N, K/2) uint8, even column in the low nibble."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_int4`: (N, K/2) uint8 -> (N, K) int32 codes."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2).to(torch.int32)  # (N, K)


@functools.cache
def cpu_int4_block() -> int:
    """Output channels per block of the CPU INT4 kernel's packed weight, 0 if its layout is not the
    one `Int4Linear` reads.

    `_convert_weight_to_int4pack_for_cpu` stores the (N, K) codes in blocks of B output channels
    (64 with AVX-512, 32 otherwise), each block (K, B/2) bytes whose byte j holds channel j in the
    low nibble and channel j + B/2 in the high one. Checked once against the op on random codes,
    so a PyTorch build that packs otherwise makes `Int4Linear` keep both layouts instead."""
    N, K = 192, 64
    codes = torch.randint(0, 16, (N, K), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    for block in (64, 32, 16):
        if torch.equal(packed, to_cpu_int4_blocks(pack_int4(codes), block)):
            return block
    return 0


def to_cpu_int4_blocks(qweight: torch.Tensor, block: int) -> torch.Tensor:
    """(N, K/2) `pack_int4` codes -> (N, K/2) uint8 in the CPU kernel's layout of `block`-channel
    blocks (`cpu_int4_block`), through uint8 temporaries only (the op itself takes int32 codes, 8x
    the bytes: 0.9 GB for qwen2.5-coder-1.5b's LM head)."""
    N, half = qweight.shape
    codes = torch.stack([qweight & 0x0F, qweight >> 4], dim=-1).view(N // block, block, 2 * half)  # (N/B, B, K)
    blocks = codes.transpose(1, 2)  # (N/B, K, B)
    # (an elementwise result keeps its inputs' transposed strides: contiguous() is not a no-op here)
    return (blocks[..., :block // 2] | (blocks[..., block // 2:] << 4)).contiguous().view(N, half)


def integer_zero_points(scales: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(z = round(8 - zeros / scales) clamped to [0, 15] as int64, mask where zeros == (8 - z) * scales exactly)."""
    s, zf = scales.to(torch.float32), zeros.to(torch.float32)
    z = torch.round(8 - zf / s).clamp(0, 15)
    return z.to(torch.int64), (8 - z) * s == zf


class Int4Linear(QuantizedLinear):
    """Group-wise asymmetric INT4: w[n, k] = (q[n, k] - 8) * scales[n, g] + zeros[n, g], g = k // G.

    This is the convention of PyTorch's `_weight_int4pack_mm*` ops (zero = min + 8 * scale),
    so the scales and zeros feed the kernels unchanged. Storage: two codes per byte.
    zero_point "integer" says every group has an integer zero point z in [0, 15]: zeros = (8 - z) *
    scales exactly (kept in float32; checked here), the form compressed-tensors stores. The kernels
    round the zeros to the activation dtype (bf16: relative error <= 2^-9 of |zero|).
    """

    FORMAT = "int4"
    ROW_COST = True  # the packed kernel's time grows with the rows (runtime.compile.static_tokens)
    ZERO_POINTS = ("float", "integer")

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None = None, zero_point: str = "float") -> None:
        out_features, half = qweight.shape
        in_features = 2 * half
        if qweight.dtype != torch.uint8 or in_features % group_size:
            raise ValueError(f"Int4Linear needs uint8 (out, in/2) codes with in divisible by group_size "
                             f"{group_size}, got {qweight.dtype} {tuple(qweight.shape)}")
        groups = (out_features, in_features // group_size)
        if scales.shape != groups or zeros.shape != groups:
            raise ValueError(f"Int4Linear scales/zeros must be {groups}, got {tuple(scales.shape)} and "
                             f"{tuple(zeros.shape)}")
        if zero_point not in self.ZERO_POINTS:
            raise ValueError(f"Int4Linear zero_point must be one of {self.ZERO_POINTS}, got {zero_point!r}")
        if zero_point == "integer" and not bool(integer_zero_points(scales, zeros)[1].all()):
            raise ValueError("Int4Linear(zero_point='integer') needs zeros == (8 - z) * scales for integers z in "
                             "[0, 15], exactly (store such zeros in float32); use zero_point='float' otherwise")
        super().__init__(in_features, out_features, bias)
        self.group_size = group_size
        self.zero_point = zero_point
        self.register_buffer("scales", scales)  # (N, K/G)
        self.register_buffer("zeros", zeros)  # (N, K/G)
        self._kernel: tuple[torch.device, torch.Tensor] | None = None
        self._sz: tuple[tuple[torch.device, torch.dtype], torch.Tensor] | None = None
        self.set_qweight(qweight)

    def set_qweight(self, qweight: torch.Tensor) -> None:
        """Store the (N, K/2) codes (`pack_int4` layout). On the CPU, when the packed kernel's
        blocks tile the output channels, only the kernel's own layout is kept (`packed`, one
        copy of the codes); otherwise `packed` holds `qweight` itself and the kernel's layout is
        built on first use next to it."""
        block = cpu_int4_block()
        self.block = block if qweight.device.type == "cpu" and block and self.out_features % block == 0 else 0
        if self.block:
            qweight = to_cpu_int4_blocks(qweight, self.block)
        self.register_buffer("packed", qweight)  # (N, K/2) uint8: `pack_int4` layout, or the kernel's (self.block)
        self._kernel = None

    @property
    def qweight(self) -> torch.Tensor:
        """The (N, K/2) codes in the `pack_int4` layout (what checkpoints store); a new tensor when
        the module keeps the kernel's layout: write through `set_qweight`."""
        if not self.block:
            return self.packed
        return pack_int4(self._block_codes())

    def _block_codes(self) -> torch.Tensor:
        """(N, K) uint8 codes from the kernel's layout."""
        K, B = self.in_features, self.block
        p = self.packed.view(-1, K, B // 2)  # (N/B, K, B/2): byte j holds channels j and j + B/2
        codes = torch.cat([p & 0x0F, p >> 4], dim=-1)  # (N/B, K, B)
        return codes.transpose(1, 2).reshape(self.out_features, K)

    def codes(self) -> torch.Tensor:
        """(N, K) int32 codes in [0, 15]."""
        return self._block_codes().to(torch.int32) if self.block else unpack_int4(self.packed)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        q = self.codes().to(torch.float32).view(self.out_features, -1, self.group_size)  # (N, K/G, G)
        s = self.scales.to(torch.float32)[..., None]
        z = self.zeros.to(torch.float32)[..., None]
        return ((q - 8) * s + z).view(self.out_features, self.in_features).to(dtype)

    def storage(self) -> dict[str, torch.Tensor]:
        return {"qweight": self.qweight, "scales": self.scales, "zeros": self.zeros}

    def meta(self) -> dict[str, Any]:
        return {**super().meta(), "group_size": self.group_size, "zero_point": self.zero_point}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> "Int4Linear":
        return cls(tensors["qweight"], tensors["scales"], tensors["zeros"], int(meta["group_size"]),
                   tensors.get("bias"), zero_point=meta.get("zero_point", "float"))

    def _packed_for_kernel(self, device: torch.device) -> torch.Tensor:
        if self.block and device.type == "cpu" and self.packed.device == device:
            return self.packed  # already the CPU kernel's layout (moved to CUDA, it is converted below)
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

    # `_tiled` splits w = (q - 8) * s + z: the GEMM's operands are [x, group sums of x] (M, K + K/G)
    # and [(q - 8) * s, z] (N, K + K/G), so the zero points cost K/G more columns instead of a pass
    # over every tile
    def _tile_inputs(self, x2: torch.Tensor) -> torch.Tensor:
        sums = x2.view(x2.shape[0], -1, self.group_size).sum(-1, dtype=torch.float32)  # (M, K/G)
        return torch.cat([x2, sums.to(x2.dtype)], dim=1)  # (M, K + K/G)

    def _tile_align(self) -> int:
        return self.block or 1

    def _tile_weight(self, start: int, stop: int, out: torch.Tensor) -> torch.Tensor:
        if self.block:
            return self._tile_weight_blocks(start, stop, out)
        K, p = self.in_features, self.packed[start:stop]  # (t, K/2) uint8
        t = stop - start
        codes = out[:, :K].view(t, K // 2, 2)
        codes[..., 0] = (p & 0x0F).view(torch.int8) - 8
        codes[..., 1] = (p >> 4).view(torch.int8) - 8
        out[:, :K].view(t, -1, self.group_size).mul_(self.scales[start:stop].to(out.dtype)[..., None])
        out[:, K:] = self.zeros[start:stop]
        return out

    def _tile_weight_blocks(self, start: int, stop: int, out: torch.Tensor) -> torch.Tensor:
        """`_tile_weight` from the kernel's layout (whole blocks of B channels, each (K, B/2) bytes).

        bf16 fills the scratch as the transposed operand (K', t), where a block is one run of B
        values per input (the GEMM then takes it as is); float32 fills it as (t, K'), because its
        GEMM is slower on the transposed operand while the bf16 one is not."""
        K, B, t = self.in_features, self.block, stop - start
        p = self.packed[start:stop].view(t // B, K, B // 2)  # (t/B, K, B/2)
        s, z = self.scales[start:stop].to(out.dtype), self.zeros[start:stop]  # (t, K/G) each
        if out.dtype == torch.float32:
            codes, p = out[:, :K].view(t // B, B, K), p.transpose(1, 2)  # (t/B, B, K), (t/B, B/2, K)
            codes[:, :B // 2] = (p & 0x0F).view(torch.int8) - 8
            codes[:, B // 2:] = (p >> 4).view(torch.int8) - 8
            out[:, :K].view(t, -1, self.group_size).mul_(s[..., None])
            out[:, K:] = z
            return out
        w_t = out.view(-1).view(out.shape[1], t)  # (K', t)
        codes, p = w_t[:K].view(K, t // B, B), p.transpose(0, 1)  # (K, t/B, B), (K, t/B, B/2)
        codes[..., :B // 2] = (p & 0x0F).view(torch.int8) - 8
        codes[..., B // 2:] = (p >> 4).view(torch.int8) - 8
        w_t[:K].view(-1, self.group_size, t).mul_(s.t().contiguous()[:, None])
        w_t[K:] = z.t()
        return w_t.t()

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cuda" and x.dtype == torch.bfloat16 and self.out_features % 8 == 0 \
                and self.in_features % (self.group_size * 8) == 0:
            x2 = x.reshape(-1, self.in_features).contiguous()
            y = torch.ops.aten._weight_int4pack_mm(x2, self._packed_for_kernel(x.device), self.group_size,
                                                   self._scales_and_zeros(x.dtype))
            y = y.view(*x.shape[:-1], self.out_features)
            return y if self.bias is None else y + self._bias(x)
        if x.device.type != "cpu":
            return self._dense(x)
        # the CPU kernel needs out_features % 16 == 0
        return self.packed_kernel(x) if self.out_features % 16 == 0 and self._packed_cpu(x) else self._tiled(x)

    def packed_kernel(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) -> (..., out) through `_weight_int4pack_mm_for_cpu`, whatever the rows."""
        return self._packed(x, lambda x2: torch.ops.aten._weight_int4pack_mm_for_cpu(
            x2, self._packed_for_kernel(x.device), self.group_size, self._scales_and_zeros(x2.dtype)))


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
        import bitsandbytes.functional as bnbf  # bitsandbytes: heavy, only for NF4 / LLM.int8

        packed, qs = bnbf.quantize_4bit(weight, blocksize=blocksize, quant_type="nf4",
                                        compress_statistics=double_quant)
        state = {"qweight": packed, **qs.as_dict(packed=True)}
        return cls(weight.shape[1], weight.shape[0], state, bias)

    def _state(self):
        import bitsandbytes.functional as bnbf  # bitsandbytes: heavy, only for NF4 / LLM.int8

        device = self.qweight.device
        if self._quant_state is None or self._quant_state[0] != device:
            parts = {k: getattr(self, _buffer_name(k)) for k in self._keys if k != "qweight"}
            self._quant_state = (device, bnbf.QuantState.from_dict(parts, device))
        return self._quant_state[1]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        import bitsandbytes.functional as bnbf  # bitsandbytes: heavy, only for NF4 / LLM.int8

        return bnbf.dequantize_4bit(self.qweight, self._state()).to(dtype)

    def storage(self) -> dict[str, torch.Tensor]:
        return {k: getattr(self, _buffer_name(k)) for k in self._keys}

    def meta(self) -> dict[str, Any]:
        return {**super().meta(), "blocksize": int(self._state().blocksize)}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> "NF4Linear":
        state = {k: v for k, v in tensors.items() if k != "bias"}
        k, n, q = int(meta["in_features"]), int(meta["out_features"]), tensors["qweight"]
        if q.dtype != torch.uint8 or 2 * q.numel() != n * k:
            raise ValueError(f"nf4 weights of a {n} x {k} linear are {n * k // 2} uint8 bytes (two codes each), "
                             f"got {q.dtype} {tuple(q.shape)}")
        return cls(k, n, state, tensors.get("bias"))

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        import bitsandbytes as bnb  # bitsandbytes: heavy, only for NF4 / LLM.int8

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
        import bitsandbytes.functional as bnbf  # bitsandbytes: heavy, only for NF4 / LLM.int8

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
        import bitsandbytes as bnb  # bitsandbytes: heavy, only for NF4 / LLM.int8

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
    if fmt == "blockq" and fmt not in FORMATS:
        import runtime.blockq  # noqa: F401  registers its formats; a cycle (it imports this module) and torch._dynamo
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantized-linear format {fmt!r}; known: {', '.join(FORMATS)}")
    return FORMATS[fmt].from_tensors(tensors, meta)
