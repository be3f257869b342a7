"""Load compressed-tensors checkpoints (`quant_method: "compressed-tensors"`, `format: "pack-quantized"`).

This is the layout llm-compressor writes and vLLM serves for W4A16 / W8A16: per quantized linear
`<name>.weight_packed` (int32, 32 / num_bits codes per word, code + 2^(num_bits-1) unsigned, element
i of a row at bits num_bits * (i mod 32/num_bits) of word i * num_bits // 32), `<name>.weight_scale`
(out, groups) for strategy "group" or (out, 1) for "channel", `<name>.weight_zero_point` for
asymmetric grids (integer codes packed the same way along the output dimension), `<name>.weight_shape`
(out, in), and `<name>.weight_g_idx` (input -> group) for the old act-order "group" layout.
Dequantization is w = (code - zero_point) * scale.

`load_compressed_tensors` reads such a checkpoint, written by `quant.save_compressed(...,
format="compressed-tensors")` or by others, into the runtime's Transformer:

- 8-bit, per channel, symmetric -> `Int8Linear` (same codes, same scales);
- 4-bit, group-wise (or per channel), symmetric or not, no act-order permutation -> `Int4Linear`
  (codes + 8, same scales, zeros = -zero_point * scale in float32, which is exact), so the packed
  CPU kernels run it;
- any other int layout of 2, 4 or 8 bits (8-bit groups, asymmetric INT8, a non-trivial g_idx) is
  dequantized to a dense weight, with a logged note naming the modules.

The packing here is our own code (no import of compressed-tensors at run time); the tests check it
against the library's `pack_to_int32` / `unpack_from_int32`. Schemes this cannot represent
(activation quantization, float weights, sparse or transformed formats) fail with a message naming
the scheme.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from runtime.errors import CheckpointError
from runtime.hf_state import read_state_dict, to_runtime_state
from runtime.model import Transformer
from runtime.qlinear import Int4Linear, Int8Linear, QuantizedLinear, pack_int4
from runtime.validate import check_finite, check_tensors, model_config, tensor_infos

log = logging.getLogger(__name__)

QUANT_METHOD = "compressed-tensors"
PACKED_FORMAT = "pack-quantized"
CT_SUFFIXES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")
PACK_BITS = (2, 4, 8)  # widths that divide 32: no code straddles two words
INT4_KERNEL_GROUPS = (256, 128, 64, 32)  # group sizes PyTorch's INT4 kernels take; a channel grid is cut into these

# runtime module -> the Hugging Face linears it fuses (per layer; rows in this order)
FUSED = {"attn.wqkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "attn.wo": ("self_attn.o_proj",),
         "mlp.w13": ("mlp.gate_proj", "mlp.up_proj"),
         "mlp.w2": ("mlp.down_proj",)}


def hf_linears(num_layers: int) -> dict[str, tuple[str, ...]]:
    """Runtime linear name -> the Hugging Face linear names whose rows it stacks."""
    out = {f"layers.{i}.{ours}": tuple(f"model.layers.{i}.{p}" for p in parts)
           for i in range(num_layers) for ours, parts in FUSED.items()}
    out["lm_head"] = ("lm_head",)
    return out


# ---------------------------------------------------------------------------------------------- packing
def _check_bits(num_bits: int) -> int:
    if num_bits not in PACK_BITS:
        raise ValueError(f"pack-quantized widths supported here are {PACK_BITS} bits, got {num_bits}")
    return 32 // num_bits


def pack_int32(codes: torch.Tensor, num_bits: int) -> torch.Tensor:
    """Signed codes (R, C) in [-2^(b-1), 2^(b-1)) -> (R, ceil(C * b / 32)) int32, compressed-tensors' layout."""
    per = _check_bits(num_bits)
    R, C = codes.shape
    v = codes.to(torch.int64) + (1 << (num_bits - 1))  # (R, C) unsigned
    v = torch.nn.functional.pad(v, (0, -C % per)).view(R, -1, per)  # (R, W, per)
    shifts = torch.arange(per, dtype=torch.int64) * num_bits
    words = (v << shifts).sum(-1)  # (R, W) in [0, 2^32)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def unpack_int32(packed: torch.Tensor, num_bits: int, cols: int) -> torch.Tensor:
    """Inverse of `pack_int32`: (R, W) int32 -> (R, cols) int8 signed codes."""
    per = _check_bits(num_bits)
    if packed.dtype != torch.int32 or packed.dim() != 2 or packed.shape[1] * per < cols:
        raise ValueError(f"packed codes must be 2-D int32 with at least {cols} codes per row, got "
                         f"{packed.dtype} {tuple(packed.shape)}")
    words = packed.to(torch.int64) & 0xFFFFFFFF  # (R, W)
    shifts = torch.arange(per, dtype=torch.int64) * num_bits
    v = (words[..., None] >> shifts) & ((1 << num_bits) - 1)  # (R, W, per)
    return (v.flatten(1)[:, :cols] - (1 << (num_bits - 1))).to(torch.int8)


# ------------------------------------------------------------------------------------------ the scheme
@dataclass(frozen=True)
class WeightScheme:
    """The weight quantization of one config group (compressed-tensors `QuantizationArgs`, int only)."""

    num_bits: int
    strategy: str  # "group" | "channel"
    symmetric: bool
    group_size: int | None
    actorder: str | None

    def __post_init__(self) -> None:
        if self.num_bits not in PACK_BITS:
            raise ValueError(f"num_bits {self.num_bits} (supported: {PACK_BITS})")
        if self.strategy not in ("group", "channel"):
            raise ValueError(f"strategy {self.strategy!r} (supported: 'group', 'channel')")
        if self.strategy == "group" and (not isinstance(self.group_size, int) or self.group_size < 1):
            raise ValueError(f"strategy 'group' with group_size {self.group_size!r}")

    def describe(self) -> str:
        grid = f"group {self.group_size}" if self.strategy == "group" else "channel"
        return f"W{self.num_bits}A16 int, {grid}, {'symmetric' if self.symmetric else 'asymmetric'}"


@dataclass(frozen=True)
class CTConfig:
    """The parts of a `quantization_config` the loader uses: (targets, scheme) per group, and ignore."""

    groups: tuple[tuple[tuple[str, ...], WeightScheme], ...]
    ignore: tuple[str, ...]

    def scheme_for(self, name: str) -> WeightScheme | None:
        """The scheme of linear `name` (None: not quantized), the first group whose targets match it."""
        if any(_matches(name, t) for t in self.ignore):
            return None
        return next((s for targets, s in self.groups if any(_matches(name, t) for t in targets)), None)


def _matches(name: str, target: str) -> bool:
    """compressed-tensors' target rule: "re:<regex>", a module class name (here every target is a
    Linear), or a module name (exact or as a dotted suffix)."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == "Linear" or name == target or name.endswith("." + target)


def is_compressed_tensors(hf_config: Any) -> bool:
    """Whether a transformers config carries a compressed-tensors `quantization_config`."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
    return isinstance(qc, dict) and qc.get("quant_method") == QUANT_METHOD


def _unsupported(where: str, what: str) -> CheckpointError:
    return CheckpointError(f"{where}: compressed-tensors {what}, which specdec cannot load; supported are "
                           "pack-quantized integer weights of 2, 4 or 8 bits (W4A16 / W8A16), group-wise or per "
                           "channel, symmetric or not, with no activation quantization")


def parse_quantization_config(qc: dict[str, Any], where: str = "config.json") -> CTConfig:
    """Check a compressed-tensors `quantization_config` and return its groups; CheckpointError naming any
    scheme, format or option the runtime cannot load."""
    if not isinstance(qc, dict) or qc.get("quant_method") != QUANT_METHOD:
        raise CheckpointError(f"{where}: quantization_config is not a compressed-tensors config")
    fmt = qc.get("format")
    for key in ("sparsity_config", "transform_config"):
        if qc.get(key):
            raise _unsupported(where, f"{key} {qc[key]!r}")
    if qc.get("kv_cache_scheme"):
        raise _unsupported(where, f"kv_cache_scheme {qc['kv_cache_scheme']!r}")
    groups_raw = qc.get("config_groups")
    if not isinstance(groups_raw, dict) or not groups_raw:
        raise CheckpointError(f"{where}: quantization_config has no config_groups; the checkpoint is corrupt")
    groups = []
    for gname, group in groups_raw.items():
        if not isinstance(group, dict):
            raise CheckpointError(f"{where}: config group {gname!r} is not an object; the checkpoint is corrupt")
        gfmt = group.get("format") or fmt
        if gfmt != PACKED_FORMAT:
            raise _unsupported(where, f"format {gfmt!r} (config group {gname!r})")
        for act in ("input_activations", "output_activations"):
            if group.get(act):
                raise _unsupported(where, f"{act} quantization {group[act]!r} (config group {gname!r})")
        w = group.get("weights")
        if not isinstance(w, dict):
            raise _unsupported(where, f"config group {gname!r} without weight quantization")
        if str(w.get("type", "int")).lower() != "int" or w.get("dynamic"):
            raise _unsupported(where, f"weights of type {w.get('type')!r}, dynamic={w.get('dynamic')!r} "
                                      f"(config group {gname!r})")
        actorder = w.get("actorder")
        if actorder not in (None, False, "weight", "static", "group", "dynamic"):
            raise _unsupported(where, f"actorder {actorder!r} (config group {gname!r})")
        strategy = w.get("strategy") or ("group" if w.get("group_size") not in (None, -1) else "channel")
        try:
            scheme = WeightScheme(int(w.get("num_bits", 8)), str(strategy).lower(), bool(w.get("symmetric", True)),
                                  w.get("group_size") if strategy == "group" else None, actorder or None)
        except (ValueError, TypeError) as err:
            raise _unsupported(where, f"weights {w!r} ({err}) (config group {gname!r})") from err
        targets = group.get("targets") or []
        if isinstance(targets, str):
            targets = [targets]
        groups.append((tuple(str(t) for t in targets), scheme))
    ignore = qc.get("ignore") or []
    return CTConfig(tuple(groups), tuple(str(t) for t in ([ignore] if isinstance(ignore, str) else ignore)))


# ------------------------------------------------------------------------------------ one linear's codes
@dataclass
class PackedLinear:
    """One compressed-tensors linear, unpacked: signed codes (N, K) int8, scale (N, G), integer zero
    points (N, G) int8 or None, g_idx (K,) or None (None also when it is the trivial k // group)."""

    name: str
    scheme: WeightScheme
    codes: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor | None
    g_idx: torch.Tensor | None

    @property
    def group_size(self) -> int:
        return self.codes.shape[1] // self.scale.shape[1]

    def dequantize(self) -> torch.Tensor:
        """The dense (N, K) float32 weight: (code - zero_point) * scale."""
        K = self.codes.shape[1]
        g = self.g_idx if self.g_idx is not None else torch.arange(K) // self.group_size  # (K,)
        q = self.codes.to(torch.float32)
        if self.zero_point is not None:
            q = q - self.zero_point.to(torch.float32)[:, g]
        return q * self.scale.to(torch.float32)[:, g]

    def exact_kind(self) -> str | None:
        """"int8" or "int4" when our Int8Linear / Int4Linear represent these codes exactly, else None."""
        if self.g_idx is not None:
            return None
        s = self.scheme
        if s.num_bits == 8 and s.strategy == "channel" and self.zero_point is None:
            return "int8"
        if s.num_bits == 4:
            return "int4"
        return None


def _words(count: int, num_bits: int) -> int:
    """int32 words one packed row of `count` codes of `num_bits` occupies."""
    return -(-count // (32 // num_bits))


def _widths_for(count: int, words: int) -> str:
    """Which supported widths pack `count` codes into `words` words per row, for a message."""
    fits = [f"{b}" for b in PACK_BITS if _words(count, b) == words]
    return f"{words} words fit num_bits={' or '.join(fits)}" if fits else "no supported width gives that"


def _zero_point(name: str, zp_packed: torch.Tensor | None, scheme: WeightScheme, rows: int, scale: torch.Tensor,
                where: Path) -> torch.Tensor | None:
    """The (N, G) int8 zero points of linear `name` (None when they are all zero), checked against the
    scheme: an asymmetric grid needs them packed along the output dimension; a symmetric one must not
    store non-zero ones (the config would then drop half of what the weights mean)."""
    config = Path(where) / "config.json"
    if zp_packed is None:
        if scheme.symmetric:
            return None
        raise CheckpointError(f"{config} says symmetric=false for {name}, but {where} has no "
                              f"{name}.weight_zero_point; the config does not describe these weights")
    if zp_packed.is_floating_point() or zp_packed.dim() != 2:
        raise CheckpointError(f"{where}: {name}.weight_zero_point is {zp_packed.dtype} {tuple(zp_packed.shape)}; "
                              "compressed-tensors stores zero points as 2-D integer codes; the checkpoint is corrupt")
    if scheme.symmetric and not zp_packed.any():
        return None  # an all-zero tensor some writers keep for symmetric grids
    words, groups = _words(rows, scheme.num_bits), scale.shape[1]
    if zp_packed.dtype != torch.int32 or tuple(zp_packed.shape) != (words, groups):
        if scheme.symmetric:
            raise CheckpointError(f"{config} says symmetric=true for {name}, but {where} stores non-zero "
                                  f"{name}.weight_zero_point {tuple(zp_packed.shape)}; the config does not describe "
                                  "these weights (an asymmetric grid is symmetric=false)")
        raise CheckpointError(f"{where}: {name}.weight_zero_point is {zp_packed.dtype} {tuple(zp_packed.shape)}, but "
                              f"{groups} groups of {rows} rows packed at num_bits={scheme.num_bits} (from {config}) "
                              f"are int32 ({words}, {groups}); the config does not describe these weights")
    zp = unpack_int32(zp_packed.t().contiguous(), scheme.num_bits, rows).t().contiguous()  # (N, G)
    if not zp.any():
        return None
    if scheme.symmetric:
        raise CheckpointError(f"{config} says symmetric=true for {name}, but {where} stores non-zero "
                              f"{name}.weight_zero_point; the config does not describe these weights (an asymmetric "
                              "grid is symmetric=false)")
    return zp


def _check_scales(name: str, scale: torch.Tensor, scheme: WeightScheme, N: int, K: int, where: Path) -> int:
    """The number of scale groups per row; CheckpointError naming the config's strategy / group_size and
    the stored weight_scale shape when they disagree."""
    config = Path(where) / "config.json"
    if not scale.is_floating_point() or scale.dim() != 2 or scale.shape[0] != N:
        raise CheckpointError(f"{where}: {name}.weight_scale is {scale.dtype} {tuple(scale.shape)}; scales of "
                              f"weight_shape {(N, K)} are floating point ({N}, groups); the checkpoint is corrupt")
    stored = scale.shape[1]
    if scheme.strategy == "channel":
        if stored != 1:
            raise CheckpointError(f"{config} says strategy='channel' (one scale per row) for {name}, but its "
                                  f"weight_scale is {tuple(scale.shape)} (groups of {K / stored:g} inputs); the config "
                                  "does not describe these weights")
        return 1
    size = scheme.group_size
    if K % size or stored != K // size:
        raise CheckpointError(f"{config} says group_size={size} for {name} ({K / size:g} groups of its {K} inputs), "
                              f"but its weight_scale is {tuple(scale.shape)} (groups of {K / stored:g} inputs); the "
                              "config does not describe these weights")
    return stored


def read_packed(name: str, state: dict[str, torch.Tensor], scheme: WeightScheme, where: Path) -> PackedLinear:
    """Unpack the compressed-tensors tensors of linear `name` from checkpoint `where`, checking the
    scheme (num_bits, strategy, group_size, symmetric: what its config.json says) against the tensors'
    dtypes and shapes: a config that does not describe the weights fails here, naming both, instead of
    decoding them into garbage."""
    def get(key: str) -> torch.Tensor | None:
        return state.get(f"{name}.{key}")

    config = Path(where) / "config.json"
    packed, scale, shape = get("weight_packed"), get("weight_scale"), get("weight_shape")
    if scale is None or shape is None:
        raise CheckpointError(f"{where}: {name} has weight_packed but lacks weight_scale or weight_shape; the "
                              "checkpoint is incomplete")
    if shape.numel() != 2 or shape.is_floating_point():
        raise CheckpointError(f"{where}: {name}.weight_shape must hold 2 integers (out, in), got {shape.tolist()}")
    N, K = (int(v) for v in shape.tolist())
    if packed.dtype != torch.int32 or packed.dim() != 2 or packed.shape[0] != N:
        raise CheckpointError(f"{where}: {name}.weight_packed is {packed.dtype} {tuple(packed.shape)}; the codes of "
                              f"weight_shape {(N, K)} are packed into int32 words, {N} rows; the checkpoint is corrupt")
    words = _words(K, scheme.num_bits)
    if packed.shape[1] != words:
        raise CheckpointError(f"{where}: {name}.weight_packed {tuple(packed.shape)} does not fit weight_shape "
                              f"{(N, K)} at num_bits={scheme.num_bits}, the width {config} gives it ({words} int32 "
                              f"words per row; {_widths_for(K, packed.shape[1])}); the config's num_bits or the "
                              "weight_shape does not describe these weights")
    codes = unpack_int32(packed, scheme.num_bits, K)  # (N, K)
    groups = _check_scales(name, scale, scheme, N, K, where)
    zp = _zero_point(name, get("weight_zero_point"), scheme, N, scale, where)
    g_idx = get("weight_g_idx")
    if g_idx is not None:
        g_idx = g_idx.to(torch.int64)
        if g_idx.shape != (K,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
            raise CheckpointError(f"{where}: {name}.weight_g_idx must map each of the {K} inputs to one of "
                                  f"{groups} groups; the checkpoint is corrupt")
        if torch.equal(g_idx, torch.arange(K) // (K // groups)):
            g_idx = None
    return PackedLinear(name, scheme, codes, scale, zp, g_idx)


# ----------------------------------------------------------------------------------- runtime modules
def _int4_module(parts: list[PackedLinear], bias: torch.Tensor | None) -> Int4Linear:
    """Stack 4-bit parts (rows) into one Int4Linear: code + 8, zeros = -zero_point * scale (exact in float32)."""
    sizes = {p.group_size for p in parts}
    K = parts[0].codes.shape[1]
    group = sizes.pop() if len(sizes) == 1 else None
    if group is None:
        raise ValueError("parts with different group sizes")
    repeat = 1
    if group not in INT4_KERNEL_GROUPS:  # a channel grid (or an odd group): cut into kernel-sized groups
        smaller = next((g for g in INT4_KERNEL_GROUPS if group % g == 0), None)
        if smaller is None:
            raise ValueError(f"group size {group} is not a multiple of 32")
        repeat, group = group // smaller, smaller
    codes = torch.cat([p.codes for p in parts]).to(torch.int32) + 8  # (N, K) in [0, 15]
    scales = torch.cat([p.scale for p in parts]).repeat_interleave(repeat, dim=1)  # (N, K/G)
    zp = torch.cat([p.zero_point if p.zero_point is not None else torch.zeros_like(p.scale, dtype=torch.int8)
                    for p in parts]).repeat_interleave(repeat, dim=1)
    zeros = -zp.to(torch.float32) * scales.to(torch.float32)  # (N, K/G)
    if K % group:
        raise ValueError(f"group size {group} does not divide {K}")
    return Int4Linear(pack_int4(codes), scales, zeros, group, bias, zero_point="integer")


def _int8_module(parts: list[PackedLinear], bias: torch.Tensor | None) -> Int8Linear:
    codes = torch.cat([p.codes for p in parts])  # (N, K) int8
    return Int8Linear(codes, torch.cat([p.scale[:, 0] for p in parts]), bias)


def to_runtime_module(parts: list[PackedLinear], bias: torch.Tensor | None) -> QuantizedLinear | None:
    """Our quantized module for the stacked `parts` when it represents them exactly, else None."""
    kinds = {p.exact_kind() for p in parts}
    if len(kinds) != 1 or None in kinds:
        return None
    try:
        return _int4_module(parts, bias) if kinds.pop() == "int4" else _int8_module(parts, bias)
    except ValueError:
        return None


# --------------------------------------------------------------------------------------------- loading
def load_compressed_tensors(ckpt: Path, hf_config: Any, dtype: torch.dtype = torch.bfloat16,
                            device: torch.device | str = "cpu", attention: str | None = None) -> Transformer:
    """The Transformer of a compressed-tensors pack-quantized checkpoint directory.

    Linears whose codes our Int8Linear / Int4Linear hold exactly keep them (packed tensors as stored,
    no re-quantization); the others are dequantized to dense `dtype` weights, with one logged note.
    Dense tensors are checked against the config like any Hugging Face checkpoint.
    """
    ckpt = Path(ckpt)
    config_file = ckpt / "config.json"
    qc = getattr(hf_config, "quantization_config", None)
    qc = qc.to_dict() if hasattr(qc, "to_dict") and not isinstance(qc, dict) else qc
    ct = parse_quantization_config(qc, str(config_file))
    cfg = model_config(hf_config, ckpt)
    state = read_state_dict(ckpt)
    packed_names = sorted({k[: -len(".weight_packed")] for k in state if k.endswith(".weight_packed")})
    if not packed_names:
        raise CheckpointError(f"{ckpt} declares compressed-tensors quantization but stores no *.weight_packed "
                              "tensor; the checkpoint is incomplete")
    unpacked: dict[str, PackedLinear] = {}
    for name in packed_names:
        scheme = ct.scheme_for(name)
        if scheme is None:
            raise CheckpointError(f"{ckpt}: {name} is packed but no config group of {config_file.name} targets it")
        unpacked[name] = read_packed(name, state, scheme, ckpt)
    dense = {k: v for k, v in state.items() if not k.endswith(CT_SUFFIXES)}
    check_finite({k: v for k, v in state.items() if v.is_floating_point()}, ckpt)
    modules: dict[str, list[PackedLinear]] = {}
    dequantized: list[str] = []
    linears = hf_linears(cfg.num_layers)
    known = {n for parts in linears.values() for n in parts}
    stray = sorted(set(unpacked) - known)
    if stray:
        raise CheckpointError(f"{ckpt}: packed tensors of {', '.join(stray[:4])}, which are not linears of a "
                              f"{hf_config.model_type} model; the checkpoint belongs to another architecture")
    for ours, parts in linears.items():
        present = [unpacked[p] for p in parts if p in unpacked]
        if not present:
            continue
        if len(present) == len(parts) and all(p.exact_kind() for p in present) and \
                len({p.exact_kind() for p in present}) == 1:
            modules[ours] = present
            continue
        for p in present:  # no exact runtime module: dense weights, in the Hugging Face names
            dense[f"{p.name}.weight"] = p.dequantize()
            dequantized.append(p.name)
    if dequantized:
        schemes = sorted({unpacked[n].scheme.describe() + (", act-order g_idx" if unpacked[n].g_idx is not None
                                                           else "") for n in dequantized})
        log.info("%s: %d linears (%s) have no exact specdec packed module; loaded dequantized to dense %s: %s",
                 ckpt, len(dequantized), "; ".join(schemes), dtype, ", ".join(dequantized[:6]) +
                 (", ..." if len(dequantized) > 6 else ""))
    check_tensors(cfg, tensor_infos(dense), where=ckpt)
    with torch.device("meta"):
        model = Transformer(cfg, attention=attention)
    runtime_state = to_runtime_state(dense, cfg, ckpt)
    for ours, parts in modules.items():
        bias = runtime_state.pop(f"{ours}.bias", None)
        module = to_runtime_module(parts, None if bias is None else bias.to(dtype))
        if module is None:  # e.g. parts whose group sizes differ: dense after all
            runtime_state[f"{ours}.weight"] = torch.cat([p.dequantize() for p in parts])
            if bias is not None:
                runtime_state[f"{ours}.bias"] = bias
            log.info("%s: %s loaded dequantized (its parts' grids differ)", ckpt, ours)
            continue
        linear = model.get_submodule(ours)
        if (module.out_features, module.in_features) != tuple(linear.weight.shape):
            raise CheckpointError(f"{ckpt}: {ours} is {module.out_features} x {module.in_features} (out x in) but "
                                  f"the config implies {tuple(linear.weight.shape)}; the config does not belong to "
                                  "these weights")
        runtime_state.pop(f"{ours}.weight", None)
        model.set_submodule(ours, module.to(device))
    tie = cfg.tie_word_embeddings and "lm_head" not in modules
    if tie:
        runtime_state.pop("lm_head.weight", None)
    # copies: a view of the safetensors memory map would keep the whole file resident
    runtime_state = {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype, copy=True)
                     for k, v in runtime_state.items() if v is not None}
    model.load_state_dict(runtime_state, assign=True, strict=False)
    if tie:
        model.lm_head.weight = model.embed.weight
    missing = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if missing:
        raise CheckpointError(f"{ckpt} lacks {len(missing)} tensors the model needs, e.g. {', '.join(missing[:4])}")
    return model.eval().requires_grad_(False)
