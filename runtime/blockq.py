"""BlockQuantLinear: a linear layer over GGUF-style block-quantized weights, run by CPU kernels.

The weight is held in one general form that covers GGUF's Q4_K, Q6_K, Q5_0, Q8_0, Q4_0 and Q4_1
exactly (`runtime.gguf_blocks` converts each):

    W[n, k] = d[n, k // S] * sc[n, k // G] * q[n, k] - dm[n, k // S] * mc[n, k // G]

q: unsigned integer codes (`bits` = 4, 5, 6 or 8); sc, mc: int8 per group of G (16 or 32) inputs
(kept in 6 bits each, as GGUF keeps Q4_K's and Q5_K's, where they all lie in 0..63: `pack_scale_codes`);
d, dm: float32 per super-block of S inputs, stored as float16 when every value is one (GGUF's own
scales are: a decode step then reads 2 bytes less per 256 inputs and channel, 4 with dm, 2 per 32
for Q5_0 / Q8_0; the kernels widen them exactly). In float32 the products d * sc and dm * mc and
d * sc * q are exact for every GGUF type above, so `dequantize()` equals `gguf.quants.dequantize`
bit for bit. INT8 / INT4 modules of `quant` convert to it too (`from_int8`, `from_int4`).

The forward runs `runtime.kernels.cpu_blockq` on the CPU: activations rounded to int8 per block
of 32 inputs (llama.cpp's arithmetic), exact integer dot products per group, float32 epilogue;
the output of a row depends only on that row (not on the row count, the other rows or the kernel
path). Without the compiled kernels (no C++ compiler, another device) it multiplies by the
dequantized weight instead, a tile of output channels at a time (`QuantizedLinear._tiled`).
Storage is in the kernels' layout (`pack_codes`), 16 output channels at a time.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from runtime.kernels import cpu_blockq
from runtime.qlinear import FORMATS, Int4Linear, Int8Linear, QuantizedLinear

LANES = cpu_blockq.LANES
BITS = (4, 5, 6, 8)
GROUPS = (16, 32)
MAX_GROUPS_PER_SUPER = 16  # the kernels keep one super-block's group results at a time (Q6_K: 16)
SCALE_DTYPES = (torch.float32, torch.float16)  # of d and dm: float16 when exact (`_narrow_scales`)


def block_width(bits: int) -> int:
    """Output channels per storage block: 32 for 4- to 6-bit codes (two channels share a byte of low
    nibbles), 16 for 8-bit ones."""
    return LANES if bits == 8 else 2 * LANES


def high_bits(bits: int) -> int:
    """Bits of each code stored beside its low nibble: 1 for 5-bit codes, 2 for 6-bit ones."""
    return bits - 4 if bits in (5, 6) else 0


def group_bytes(bits: int, group: int) -> int:
    """Bytes of one group of one block: 16 G of low-nibble (or 8-bit) rows, plus 4 G per high bit."""
    return 16 * group + 4 * group * high_bits(bits)


def pack_scale_codes(sc: torch.Tensor, mc: torch.Tensor) -> torch.Tensor:
    """sc, mc (..., 32) int8 in 0..63 (one group of a 32-channel block) -> (..., 48) uint8, the kernels'
    6-bit form: byte c < 32 holds sc[c] & 15 | (mc[c] & 15) << 4, byte 32 + c (c < 16) holds bits 4-5 of
    sc[c], sc[16 + c], mc[c], mc[16 + c] in its bits 0-1, 2-3, 4-5, 6-7."""
    sc, mc = sc.to(torch.uint8), mc.to(torch.uint8)
    low = (sc & 15) | ((mc & 15) << 4)
    high = (sc[..., :16] >> 4) | ((sc[..., 16:] >> 4) << 2) | ((mc[..., :16] >> 4) << 4) | ((mc[..., 16:] >> 4) << 6)
    return torch.cat([low, high], -1).contiguous()


def unpack_scale_codes(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`pack_scale_codes` undone: (..., 48) uint8 -> sc, mc (..., 32) int8."""
    low, high = packed[..., :32], packed[..., 32:]
    sc = (low & 15) | (torch.cat([high & 3, (high >> 2) & 3], -1) << 4)
    mc = (low >> 4) | (torch.cat([(high >> 4) & 3, (high >> 6) & 3], -1) << 4)
    return sc.to(torch.int8), mc.to(torch.int8)


def _bits_to_bytes(bits: torch.Tensor) -> torch.Tensor:
    """(..., 64) values in {0, 1} -> (..., 8) bytes, bit i of the little-endian word = value i."""
    weights = (1 << torch.arange(8, dtype=torch.int32, device=bits.device))
    return (bits.to(torch.int32).view(*bits.shape[:-1], 8, 8) * weights).sum(-1).to(torch.uint8)


def _bytes_to_bits(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `_bits_to_bytes`: (..., 8) bytes -> (..., 64) values in {0, 1} (uint8)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed[..., None] >> shifts) & 1).flatten(-2)


def pack_codes(q: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """(N, K) uint8 codes -> (N/W, K/G, `group_bytes`) uint8 in the kernels' layout (W = `block_width`).

    Per block and group of G inputs: G/4 rows of 64 bytes, row r holding channel c's inputs
    4r..4r+3 at bytes 4c..4c+3. Below 8 bits, channel c's low 4 bits in the low nibble and channel
    16 + c's in the high nibble. After the G/4 rows, 5 bits add per row bit 4 as two planes (set 0's,
    then set 1's, 8 bytes each, bit i for byte i of the row); 6 bits add per 4 rows (a quad) two
    64-byte vectors (set 0's, then set 1's) whose byte i holds bits 4-5 of row 4q + j's code at byte
    i in its bits 2j, 2j + 1 (so a 16-bit shift and a mask bring a row's pairs to bits 4-5)."""
    N, K = q.shape
    W, R = block_width(bits), group // 4
    rows = q.view(N // W, W // LANES, LANES, K // group, R, 4).permute(0, 3, 4, 1, 2, 5)
    rows = rows.reshape(N // W, K // group, R, W // LANES, 4 * LANES)  # (N/W, K/G, G/4, sets, 64)
    if bits == 8:
        return rows.reshape(N // W, K // group, 16 * group).contiguous()
    low = (rows[..., 0, :] & 0x0F) | ((rows[..., 1, :] & 0x0F) << 4)  # (N/W, K/G, G/4, 64)
    parts = [low.reshape(N // W, K // group, 16 * group)]
    if bits == 5:
        parts.append(_bits_to_bytes((rows >> 4) & 1).reshape(N // W, K // group, 4 * group))  # (.., sets, 8)
    if bits == 6:
        pairs = ((rows >> 4) & 3).view(N // W, K // group, R // 4, 4, W // LANES, 4 * LANES)  # (.., quads, 4, sets, 64)
        shifts = (2 * torch.arange(4, dtype=torch.uint8)).view(1, 1, 1, 4, 1, 1)
        high = (pairs << shifts).sum(3, dtype=torch.uint8)  # (N/W, K/G, G/16, sets, 64): disjoint bits
        parts.append(high.reshape(N // W, K // group, 8 * group))
    return torch.cat(parts, dim=-1).contiguous()


def unpack_codes(packed: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Inverse of `pack_codes`: (N/W, K/G, group bytes) -> (N, K) uint8."""
    nb, ng, _ = packed.shape
    W, R = block_width(bits), group // 4
    low = packed[..., :16 * group].reshape(nb, ng, R, 1, 4 * LANES)
    if bits == 8:
        rows = low
    else:
        rows = torch.cat([low & 0x0F, low >> 4], dim=3)  # (N/W, K/G, G/4, 2, 64)
        rows = rows | (_high(packed[..., 16 * group:], bits, R) << 4)
    rows = rows.reshape(nb, ng, R, W // LANES, LANES, 4)
    return rows.permute(0, 3, 4, 1, 2, 5).reshape(nb * W, ng * group)


def _high(packed: torch.Tensor, bits: int, R: int) -> torch.Tensor:
    """The high bits of 5- and 6-bit codes, (..., high bytes) -> (..., R, 2, 64) uint8 values below
    2**(bits - 4) (per row, set, byte of the row); zeros for 4 and 8 bits."""
    lead = packed.shape[:-1]
    if bits == 5:
        return _bytes_to_bits(packed.reshape(*lead, R, 2, 8))
    if bits == 6:
        high = packed.reshape(*lead, R // 4, 1, 2, 64)  # (..., quads, 1, sets, 64)
        shifts = (2 * torch.arange(4, dtype=torch.uint8, device=packed.device)).view(4, 1, 1)
        return ((high >> shifts) & 3).reshape(*lead, R, 2, 64)
    return torch.zeros(*lead, R, 2, 64, dtype=torch.uint8, device=packed.device)


def _blocks(t: torch.Tensor, W: int) -> torch.Tensor:
    """(N, X) per-channel values -> (N/W, X, W), the kernels' layout of sc, mc, d, dm."""
    N, X = t.shape
    return t.view(N // W, W, X).transpose(1, 2).contiguous()


def _channels(t: torch.Tensor) -> torch.Tensor:
    """Inverse of `_blocks`: (N/W, X, W) -> (N, X)."""
    nb, X, W = t.shape
    return t.transpose(1, 2).reshape(nb * W, X)


class BlockQuantLinear(QuantizedLinear):
    """Block-quantized weights (GGUF K-quants and legacy quants, `quant` INT4 / INT8): see the module
    docstring for the formula; `bits`, `group_size` (G) and `super_block` (S) describe the grid, and
    `zero` > 0 says dm = zero * d (symmetric formats: Q6_K, Q8_0, Q5_0, Q4_0), which is then not stored."""

    FORMAT = "blockq"
    ROW_COST = True  # 8 rows cost about twice one row (runtime.compile.static_tokens)

    def __init__(self, codes: torch.Tensor, sc: torch.Tensor, mc: torch.Tensor, d: torch.Tensor,
                 dm: torch.Tensor | None, bits: int, group_size: int, super_block: int,
                 bias: torch.Tensor | None = None, zero: float = 0.0) -> None:
        """Tensors in the kernels' layout (W = `block_width(bits)`): codes (N/W, K/G, group bytes) uint8,
        sc / mc (N/W, K/G, W) int8 (kept packed in 6 bits, `packed`, where W is 32, the mins are codes of
        their own and all lie in 0..63), d / dm (N/W, K/S, W) float32 or float16 (kept as float16 when every
        value is exactly one), dm None when `zero` (a power of two) gives it (`from_canonical` builds them
        from (N, K) codes)."""
        if bits not in BITS or group_size not in GROUPS or super_block <= 0 or super_block % group_size \
                or super_block // group_size > MAX_GROUPS_PER_SUPER:
            raise ValueError(f"BlockQuantLinear needs bits in {BITS}, group_size in {GROUPS} and a super_block "
                             f"of 1 to {MAX_GROUPS_PER_SUPER} groups, got {bits}, {group_size}, {super_block}")
        if (dm is None) == (not zero) or (zero and (zero < 0 or math.frexp(zero)[0] != 0.5)):
            raise ValueError(f"BlockQuantLinear takes either dm or a zero that is a power of two, got "
                             f"dm={'None' if dm is None else 'a tensor'}, zero={zero!r}")
        W, nbytes = block_width(bits), group_bytes(bits, group_size)
        if codes.dim() != 3 or codes.dtype != torch.uint8 or codes.shape[2] != nbytes:
            raise ValueError(f"BlockQuantLinear codes must be uint8 (N/{W}, K/G, {nbytes}), "
                             f"got {codes.dtype} {tuple(codes.shape)}")
        nb, ng, _ = codes.shape
        out_features, in_features = nb * W, ng * group_size
        if in_features % super_block or in_features % cpu_blockq.ACT_BLOCK:
            raise ValueError(f"BlockQuantLinear in_features {in_features} must be a multiple of the super-block "
                             f"{super_block} and of {cpu_blockq.ACT_BLOCK}")
        checks = [("sc", sc, (torch.int8,), group_size), ("mc", mc, (torch.int8,), group_size),
                  ("d", d, SCALE_DTYPES, super_block)]
        if dm is not None:
            checks.append(("dm", dm, SCALE_DTYPES, super_block))
        for name, t, dtypes, per in checks:
            want = (nb, in_features // per, W)
            if t.dtype not in dtypes or tuple(t.shape) != want:
                raise ValueError(f"BlockQuantLinear {name} must be {' or '.join(map(str, dtypes))} {want}, got "
                                 f"{t.dtype} {tuple(t.shape)}")
        d, dm = _narrow_scales(d, dm)
        super().__init__(in_features, out_features, None if bias is None else bias.to(torch.float32))
        self.bits, self.group_size, self.super_block, self.zero = bits, group_size, super_block, float(zero)
        shared = mc is sc or (mc.data_ptr() == sc.data_ptr() and mc.shape == sc.shape)
        # Q4_K's and Q5_K's scale and min codes are 6-bit: kept so, they take 48 bytes a group and block, not 64
        self.packed = W == 32 and not shared and all(bool(((t >= 0) & (t < 64)).all()) for t in (sc, mc))
        for name, t in (("codes", codes), ("sc", pack_scale_codes(sc, mc) if self.packed else sc), ("d", d)):
            self.register_buffer(name, t.contiguous())
        # formats whose mins share the scales' codes (Q6_K, Q8_0, Q5_0, ...) keep one tensor for both:
        # the kernels read it once from memory; packed codes hold both
        self.register_buffer("mc", self.sc if shared or self.packed else mc.contiguous())
        self.register_buffer("dm", None if dm is None else dm.contiguous())

    @classmethod
    def from_canonical(cls, q: torch.Tensor, sc: torch.Tensor, mc: torch.Tensor, d: torch.Tensor, dm: torch.Tensor,
                       bits: int, group_size: int, super_block: int,
                       bias: torch.Tensor | None = None) -> "BlockQuantLinear":
        """From per-channel tensors: q (N, K) codes < 2**bits, sc / mc (N, K/G) int8, d / dm (N, K/S).
        4- to 6-bit codes need N divisible by 32 (two channels share a byte); otherwise they are
        stored in 8 bits (exact, more bytes). Mins equal to the scales' codes are kept once, and a dm
        that is one power of two times d (a symmetric grid) is not kept at all (`zero`)."""
        N, K = q.shape
        if N % LANES:
            raise ValueError(f"BlockQuantLinear needs out_features divisible by {LANES}, got {N}")
        if int(q.max()) >= 1 << bits or int(q.min()) < 0:
            raise ValueError(f"codes must lie in [0, {(1 << bits) - 1}] for {bits} bits")
        if bits != 8 and N % block_width(bits):
            bits = 8
        W = block_width(bits)
        sc, mc, d, dm = sc.to(torch.int8), mc.to(torch.int8), d.to(torch.float32), dm.to(torch.float32)
        scb = _blocks(sc, W)
        shared = torch.equal(sc, mc)
        mcb = scb if shared else _blocks(mc, W)
        zero = _power_of_two_ratio(dm, d) if shared else 0.0
        return cls(pack_codes(q.to(torch.uint8), bits, group_size), scb, mcb, _blocks(d, W),
                   None if zero else _blocks(dm, W), bits, group_size, super_block, bias, zero)

    @classmethod
    def from_int8(cls, module: Int8Linear) -> "BlockQuantLinear":
        """The same weights as an `Int8Linear` (per-channel symmetric): q + 128 as codes. Exact for
        scales of at most 16 significant bits (the bf16 scales `quant` stores)."""
        N, K = module.out_features, module.in_features
        s = module.scales.to(torch.float32)[:, None].expand(N, K // 32)  # the channel's scale for every group
        ones = torch.ones(N, K // 32, dtype=torch.int8)
        return cls.from_canonical((module.qweight.to(torch.int16) + 128).to(torch.uint8), ones, ones, s, 128 * s,
                                  8, 32, 32, module.bias)

    @classmethod
    def from_int4(cls, module: Int4Linear) -> "BlockQuantLinear":
        """An `Int4Linear`'s weights, w = (q - 8) s + z = s q - (8 s - z), with s and 8 s - z in float32
        (exact for bf16 scales and integer zero points; float zeros round once more, 2^-24 relative)."""
        G = module.group_size
        if G % 32:
            raise ValueError(f"INT4 group size {G} is not a multiple of 32; keep the Int4Linear")
        N, K = module.out_features, module.in_features
        s = module.scales.to(torch.float32)
        ones = torch.ones(N, K // 32, dtype=torch.int8)
        return cls.from_canonical(module.codes().to(torch.uint8), ones, ones, s, 8 * s - module.zeros.to(torch.float32),
                                  4, 32, G, module.bias)

    @property
    def width(self) -> int:
        """Output channels per storage block (`block_width`)."""
        return block_width(self.bits)

    def scale_codes(self, blocks: slice | torch.Tensor = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
        """sc, mc (n / W, K/G, W) int8 of the given channel blocks, unpacked."""
        if self.packed:
            return unpack_scale_codes(self.sc[blocks])
        return self.sc[blocks], self.mc[blocks]

    def canonical(self, blocks: slice | torch.Tensor = slice(None)) -> tuple[torch.Tensor, ...]:
        """(q (n, K) uint8, sc, mc (n, K/G) int8, d, dm (n, K/S) float32) of the given channel blocks."""
        d = _channels(self.d[blocks].float())
        dm = _channels(self.dm[blocks].float()) if self.dm is not None else d * self.zero
        sc, mc = self.scale_codes(blocks)
        return unpack_codes(self.codes[blocks], self.bits, self.group_size), _channels(sc), _channels(mc), d, dm

    def select_rows(self, ids: torch.Tensor) -> "BlockQuantLinear":
        """A module of output channels `ids` only (any order; bias too), on the same grid, exactly."""
        q, sc, mc, d, dm = self.canonical()
        bias = None if self.bias is None else self.bias.detach()[ids]
        return BlockQuantLinear.from_canonical(q[ids], sc[ids], mc[ids], d[ids], dm[ids], self.bits, self.group_size,
                                               self.super_block, bias)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self._dequantize_blocks(slice(None)).to(dtype)

    def _dequantize_blocks(self, blocks: slice | torch.Tensor) -> torch.Tensor:
        """float32 (n * W, K) weight rows of the given channel blocks."""
        q, sc, mc, d, dm = self.canonical(blocks)
        n, reps = q.shape[0], self.super_block // self.group_size
        s = sc.to(torch.float32) * d.repeat_interleave(reps, dim=1)  # (n, K/G)
        mn = mc.to(torch.float32) * dm.repeat_interleave(reps, dim=1)
        w = s[..., None] * q.view(n, -1, self.group_size).to(torch.float32) - mn[..., None]  # (n, K/G, G)
        return w.reshape(n, self.in_features)

    def dequantize_rows(self, start: int, stop: int, out: torch.Tensor) -> torch.Tensor:
        if start % self.width or stop % self.width:
            return super().dequantize_rows(start, stop, out)
        return out.copy_(self._dequantize_blocks(slice(start // self.width, stop // self.width)))

    def rows(self, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Weight rows (output channels) `index` (...) -> (..., K) in `dtype`: an embedding lookup.
        Reads only the rows' own codes and scales (no data-dependent shapes: it compiles)."""
        flat = index.reshape(-1)
        T, ng, R, G, W = flat.numel(), self.in_features // self.group_size, self.group_size // 4, self.group_size, \
            self.width
        blocks, lane = flat // W, flat % W
        at = torch.arange(T, device=flat.device)
        codes = self.codes[blocks]  # (T, K/G, group bytes)
        rows = codes[..., :16 * G].view(T, ng, R, LANES, 4)[at, :, :, lane % LANES]  # (T, K/G, G/4, 4)
        if self.bits != 8:
            high = (lane >= LANES).view(T, 1, 1, 1)
            rows = torch.where(high, rows >> 4, rows & 0x0F)
        if self.bits in (5, 6):
            high = _high(codes[..., 16 * G:], self.bits, R)[at, :, :, (lane >= LANES).long()]  # (T, K/G, G/4, 64)
            rows = rows | (high.reshape(T, ng, R, LANES, 4)[at, :, :, lane % LANES] << 4)  # (T, K/G, G/4, 4)
        reps = self.super_block // G
        d = self.d[blocks, :, lane].float()  # (T, K/S)
        dm = self.dm[blocks, :, lane].float() if self.dm is not None else d * self.zero
        sc, mc = (t[at, :, lane] for t in self.scale_codes(blocks))  # (T, K/G): each row's lane
        s = sc.to(torch.float32) * d.repeat_interleave(reps, dim=1)
        mn = mc.to(torch.float32) * dm.repeat_interleave(reps, dim=1)
        w = s[..., None] * rows.reshape(T, ng, G).to(torch.float32) - mn[..., None]  # (T, K/G, G)
        return w.to(dtype).view(*index.shape, self.in_features)

    def storage(self) -> dict[str, torch.Tensor]:
        """The packed tensors; `mc` only when the mins have codes of their own, `dm` without a zero. Scale
        codes are written as int8 (the form the constructor takes), packed or not."""
        sc, mc = self.scale_codes()
        out = {"codes": self.codes, "sc": sc, "d": self.d}
        if self.packed or self.mc is not self.sc:
            out["mc"] = mc
        if self.dm is not None:
            out["dm"] = self.dm
        return out

    def nbytes(self) -> int:
        """Bytes the module holds in memory: its scale codes as kept (6-bit ones packed), each tensor once."""
        held = {t.data_ptr(): t for t in (self.codes, self.sc, self.mc, self.d, self.dm, self.bias) if t is not None}
        return sum(t.numel() * t.element_size() for t in held.values())

    def meta(self) -> dict[str, Any]:
        return {**super().meta(), "bits": self.bits, "group_size": self.group_size, "super_block": self.super_block,
                "zero": self.zero}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> "BlockQuantLinear":
        return cls(tensors["codes"], tensors["sc"], tensors.get("mc", tensors["sc"]), tensors["d"], tensors.get("dm"),
                   int(meta["bits"]), int(meta["group_size"]), int(meta["super_block"]), tensors.get("bias"),
                   float(meta.get("zero", 0.0)))

    def _tile_align(self) -> int:
        return self.width

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and cpu_blockq.available():
            mc = self.sc if self.packed else self.mc  # packed: both in one tensor
            return cpu_blockq.blockq_mm(x, self.codes, self.sc, mc, self.d, self.dm, self.bias, self.bits,
                                        self.group_size, self.super_block, self.zero)
        if x.device.type != "cpu":
            return F.linear(x, self.dequantize(x.dtype).to(x.device), self._bias(x))
        return self._tiled(x)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, format={self.FORMAT}, "
                f"bits={self.bits}, group_size={self.group_size}, super_block={self.super_block}")


def _narrow_scales(d: torch.Tensor, dm: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """d and dm as float16 when every value of both is exactly a float16 (GGUF's scales are), else both
    float32: the kernels take either and widen float16 exactly."""
    d32 = d.float()
    dm32 = None if dm is None else dm.float()
    if all(t is None or torch.equal(t.half().float(), t) for t in (d32, dm32)):
        return d.half(), None if dm is None else dm.half()
    return d32, dm32


def _power_of_two_ratio(dm: torch.Tensor, d: torch.Tensor) -> float:
    """z > 0 when dm == z * d exactly everywhere for one power of two z (a symmetric grid), else 0."""
    nonzero = d != 0
    if not bool(nonzero.any()):
        return 0.0
    z = float((dm[nonzero] / d[nonzero]).flatten()[0])
    if z <= 0 or math.frexp(z)[0] != 0.5:
        return 0.0
    return z if torch.equal(dm, d * z) else 0.0


FORMATS[BlockQuantLinear.FORMAT] = BlockQuantLinear


def to_block_quant(model: nn.Module) -> int:
    """Swap `model`'s Int4Linear (group size a multiple of 32) and Int8Linear modules for
    BlockQuantLinear modules holding the same weights (`from_int4`, `from_int8`), in place, so that
    a checkpoint quantized by `quant` runs the same CPU kernels as a GGUF file; returns how many
    modules changed. Others (NF4, 2:4, odd shapes) stay as they are."""
    swaps = []
    for name, module in model.named_modules():
        if module.__class__ is Int4Linear and module.group_size % 32 == 0 and module.out_features % LANES == 0:
            swaps.append((name, BlockQuantLinear.from_int4))
        elif module.__class__ is Int8Linear and module.in_features % 32 == 0 and module.out_features % LANES == 0:
            swaps.append((name, BlockQuantLinear.from_int8))
    for name, convert in swaps:
        model.set_submodule(name, convert(model.get_submodule(name)))
    return len(swaps)


class QuantizedEmbedding(nn.Module):
    """Token embedding over a BlockQuantLinear's storage (vocab, hidden): rows dequantized per lookup
    into `dtype`. A tied LM head is the same `table` module."""

    def __init__(self, table: BlockQuantLinear, dtype: torch.dtype) -> None:
        super().__init__()
        self.table, self.dtype = table, dtype
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features

    def _apply(self, fn, recurse: bool = True):
        """`nn.Module._apply`: a conversion of the model to a floating dtype (`.to(torch.float16)`)
        changes the dtype of the rows looked up, as it would an `nn.Embedding`'s weight; the table
        keeps its storage (`QuantizedLinear._apply`)."""
        target = fn(torch.empty(0, dtype=self.dtype)).dtype
        if target.is_floating_point:
            self.dtype = target
        return super()._apply(fn, recurse)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (...) -> (..., hidden) in `dtype`."""
        return self.table.rows(tokens, self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, format={self.table.FORMAT}, dtype={self.dtype}"
