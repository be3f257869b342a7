"""Export a compressed model as a compressed-tensors checkpoint (pack-quantized W4A16 / W8A16).

`save_compressed_tensors(model, out_dir, tokenizer)` (also `quant.save_compressed(...,
format="compressed-tensors")`) writes a Hugging Face checkpoint that `transformers` (with the
`compressed-tensors` package), vLLM and `runtime.load_model` load: config.json with
`quantization_config = {"quant_method": "compressed-tensors", "format": "pack-quantized",
"config_groups": ..., "ignore": [...]}`, and per quantized linear, in Hugging Face names (q/k/v and
gate/up split again), `weight_packed` (int32), `weight_scale`, `weight_zero_point` (asymmetric grids,
int32 packed along the output dimension), `weight_shape`. Layouts (runtime.compressed_tensors):

- `Int8Linear` (per-channel symmetric INT8) -> 8 bits, strategy "channel", symmetric: the same codes
  and scales, exactly.
- `Int4Linear` (group-wise, w = (q - 8) * s + z) -> 4 bits, strategy "group": codes q - 8, the same
  scales, and the integer zero point zp = -z / s. compressed-tensors stores zero points as integers.
  A model quantized with `Int4WeightOnly(zero_point="integer")` (RTN or GPTQ) has them already
  (z = -zp * s exactly, in float32), so its export is exact as it is. With float zeros (the form
  PyTorch's INT4 kernels take, zero = min + 8 * scale) a group whose z / s is not an integer cannot be
  stored as is: `align_zero_points(model)` moves each such group onto the nearest integer zero point in
  place (codes re-rounded, error <= scale / 2 per weight, reported as SQNR); the export does the same
  on its copy with a logged warning. The move costs quality (smollm2, INT4 g64 RTN: perplexity
  8.57 -> 13.94, dense 6.54; docs/exports.md); INT8 exports are exact as they are.
  GPTQ with act_order here keeps groups in input order (static groups), so it is actorder "weight"
  and needs no g_idx.
- 2:4 sparse linears (and any other format) are written dense: vLLM dropped the 2:4 sparse format
  (sparse-24-bitmask) in 2026, so a sparse model is served as a dense (or INT4 pack-quantized) one;
  a log line says which modules went dense.

The packing is `runtime.compressed_tensors.pack_int32` (our own code, checked against the
library's in the tests), so exporting needs no extra package; loading the export with
`transformers` needs `pip install compressed-tensors`.
"""

from __future__ import annotations

import copy
import logging
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from runtime.compressed_tensors import (
    PACKED_FORMAT,
    QUANT_METHOD,
    WeightScheme,
    hf_linears,
    pack_int32,
)
from runtime.hf_state import dense_hf_state
from runtime.output_paths import prepare_output_dir, write_output_dir
from runtime.qlinear import Int4Linear, Int8Linear, QuantizedLinear, Sparse24Linear, integer_zero_points, pack_int4

log = logging.getLogger(__name__)

MARKER, WHAT = "specdec_export.json", "compressed-tensors export"
CT_VERSION = "0.20.0"  # the compressed-tensors release whose schema this writes (and the tests load)


def _zero_points(mod: Int4Linear) -> tuple[torch.Tensor, torch.Tensor]:
    """(integer zero points (N, G) int64 in [-8, 7], mask (N, G) of groups where -zp * s == z exactly)."""
    z, exact = integer_zero_points(mod.scales, mod.zeros)
    return z - 8, exact


def align_zero_points(model: nn.Module) -> dict[str, Any]:
    """Put every Int4Linear group of `model` on an integer zero point, in place, so that a
    compressed-tensors export holds exactly the model's weights.

    Per group: zp = round(-z / s) clamped to [-8, 7], codes re-rounded to clamp(round(w / s + zp), -8, 7)
    from the current weights w, zeros set to -zp * s (stored in float32, where it is exact). Groups
    already on the lattice keep their codes. Returns {"groups", "moved", "sqnr_db"} (SQNR of the new
    weights against the old, over the moved modules; inf when nothing moved). Every Int4Linear is
    marked zero_point="integer" afterwards. A model quantized with zero_point="integer" moves nothing.
    """
    groups = moved = 0
    signal = noise = 0.0
    for mod in model.modules():
        if not isinstance(mod, Int4Linear):
            continue
        zp, exact = _zero_points(mod)
        groups += exact.numel()
        if bool(exact.all()):
            mod.zero_point = "integer"
            continue
        moved += int((~exact).sum())
        codes, zeros = _aligned_int4(mod, zp)
        old = mod.dequantize(torch.float32)
        mod.set_qweight(pack_int4(codes.to(torch.int32) + 8))
        mod.zeros = zeros  # float32: -zp * s is exact there, not always in bf16
        mod._sz = None
        mod.zero_point = "integer"
        new = mod.dequantize(torch.float32)
        signal += float(old.double().pow(2).sum())
        noise += float((old - new).double().pow(2).sum())
    sqnr = float("inf") if noise == 0 else 10 * math.log10(signal / noise)
    return {"groups": groups, "moved": moved, "sqnr_db": sqnr}


def _aligned_int4(mod: Int4Linear, zp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Signed codes (N, K) int8 and float32 zeros (N, G) of `mod` moved onto integer zero points `zp`."""
    N, K, G = mod.out_features, mod.in_features, mod.group_size
    s = mod.scales.to(torch.float32)
    w = mod.dequantize(torch.float32).view(N, K // G, G)
    codes = torch.round(w / s[..., None] + zp[..., None].to(torch.float32)).clamp(-8, 7)  # (N, K/G, G)
    return codes.view(N, K).to(torch.int8), -zp.to(torch.float32) * s


def ct_tensors(mod: QuantizedLinear) -> tuple[WeightScheme, dict[str, torch.Tensor], int] | None:
    """(scheme, {"codes" (N, K) int8, "scale" (N, G), "zero_point" (N, G) int8 | absent}, groups moved
    off a float zero point) for a module compressed-tensors can hold packed; None for the others."""
    if isinstance(mod, Int8Linear):
        scheme = WeightScheme(8, "channel", True, None, None)
        return scheme, {"codes": mod.qweight, "scale": mod.scales[:, None]}, 0
    if isinstance(mod, Int4Linear):
        zp, exact = _zero_points(mod)
        if bool(exact.all()):
            codes = (mod.codes() - 8).to(torch.int8)
        else:
            codes, _ = _aligned_int4(mod, zp)
        symmetric = not bool(zp.any())
        scheme = WeightScheme(4, "group", symmetric, mod.group_size, None)
        out = {"codes": codes, "scale": mod.scales}
        if not symmetric:
            out["zero_point"] = zp.to(torch.int8)
        return scheme, out, int((~exact).sum())
    return None


def _scheme_args(scheme: WeightScheme, actorder: str | None) -> dict[str, Any]:
    """The `weights` QuantizationArgs of a config group, as compressed-tensors serialises them."""
    return {"num_bits": scheme.num_bits, "type": "int", "symmetric": scheme.symmetric,
            "group_size": scheme.group_size, "strategy": scheme.strategy, "block_structure": None,
            "dynamic": False, "actorder": actorder, "observer": "minmax", "observer_kwargs": {}}


def _act_order(model: nn.Module) -> str | None:
    """"weight" when the recipe ran GPTQ with act_order (static groups: no g_idx), else None."""
    steps = getattr(model, "compression_recipe", [])
    return "weight" if any(isinstance(step, dict) and step.get("act_order") for step in steps) else None


def build_export(model: nn.Module, dtype: torch.dtype | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(Hugging Face-named tensors, quantization_config) of the compressed-tensors export of `model`."""
    cfg = model.config
    dtype = dtype or model.dtype
    linears = hf_linears(cfg.num_layers)
    packed_ours: dict[str, tuple[WeightScheme, dict[str, torch.Tensor]]] = {}
    dense_mods: list[str] = []
    moved = 0
    for name, mod in model.named_modules():
        if not isinstance(mod, QuantizedLinear):
            continue
        got = ct_tensors(mod) if name in linears else None
        if got is None:
            dense_mods.append(f"{name} ({mod.FORMAT})")
            continue
        scheme, tensors, n_moved = got
        packed_ours[name] = (scheme, tensors)
        moved += n_moved
    if dense_mods:
        sparse = any(isinstance(m, Sparse24Linear) for m in model.modules())
        log.warning("compressed-tensors export: %d linears written dense (%s)%s", len(dense_mods),
                    ", ".join(dense_mods[:4]) + (", ..." if len(dense_mods) > 4 else ""),
                    "; 2:4 sparse weights are exported dense because vLLM dropped the 2:4 sparse format in 2026"
                    if sparse else "")
    if moved:
        log.warning("compressed-tensors export: %d INT4 groups have a zero point off the integer grid "
                    "compressed-tensors stores; they were moved to the nearest integer zero point (codes "
                    "re-rounded, error <= scale / 2; this costs quality, e.g. smollm2 INT4 g64 perplexity "
                    "8.57 -> 13.94, docs/exports.md). Quantize with Int4WeightOnly(zero_point='integer') for an "
                    "exact export, or run quant.compressed_tensors.align_zero_points(model) before evaluating and "
                    "exporting so that what you measure is what you export", moved)
    state = dense_hf_state(model, dtype, skip=set(packed_ours))
    by_scheme: dict[WeightScheme, list[str]] = defaultdict(list)
    for ours, (scheme, t) in packed_ours.items():
        parts = linears[ours]
        N = t["codes"].shape[0]
        sizes = _part_rows(model, ours, N, len(parts))
        start = 0
        for hf_name, rows in zip(parts, sizes):
            sl = slice(start, start + rows)
            start += rows
            codes = t["codes"][sl]
            state[f"{hf_name}.weight_packed"] = pack_int32(codes, scheme.num_bits)
            state[f"{hf_name}.weight_scale"] = t["scale"][sl].contiguous()  # as the model stores it
            state[f"{hf_name}.weight_shape"] = torch.tensor([rows, codes.shape[1]], dtype=torch.int64)
            if "zero_point" in t:
                zp = t["zero_point"][sl].t().contiguous()  # (G, rows): packed along the output dimension
                state[f"{hf_name}.weight_zero_point"] = pack_int32(zp, scheme.num_bits).t().contiguous()
            by_scheme[scheme].append(hf_name)
    actorder = _act_order(model)
    all_linears = {n for parts in linears.values() for n in parts}
    packed_hf = {n for names in by_scheme.values() for n in names}
    ignore = sorted(all_linears - packed_hf, key=_natural)
    single = len(by_scheme) == 1
    groups = {}
    for i, (scheme, names) in enumerate(by_scheme.items()):
        targets = ["Linear"] if single else sorted(names, key=_natural)
        groups[f"group_{i}"] = {"targets": targets, "weights": _scheme_args(scheme, actorder if scheme.num_bits == 4
                                                                             else None),
                                "input_activations": None, "output_activations": None, "format": PACKED_FORMAT}
    qc = {"quant_method": QUANT_METHOD, "format": PACKED_FORMAT, "quantization_status": "compressed",
          "config_groups": groups, "ignore": ignore, "kv_cache_scheme": None, "sparsity_config": {},
          "transform_config": {}, "global_compression_ratio": None, "version": CT_VERSION}
    return {k: v.contiguous() for k, v in state.items()}, qc


def _natural(name: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in name.split("."))


def _part_rows(model: nn.Module, ours: str, rows: int, parts: int) -> list[int]:
    """Row counts of the Hugging Face linears a runtime linear stacks (q, k, v / gate, up / one)."""
    cfg = model.config
    if parts == 3:
        return [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim]
    if parts == 2:
        return [cfg.intermediate_size, cfg.intermediate_size]
    return [rows]


def save_compressed_tensors(model: nn.Module, out_dir: str | Path, tokenizer: Any = None,
                            overwrite: bool = False) -> Path:
    """Write `model` as a compressed-tensors pack-quantized Hugging Face checkpoint (see the module doc).

    `out_dir` must be new or empty; `overwrite=True` replaces a previous export there (and nothing
    else). Returns the directory.
    """
    prepare_output_dir(out_dir, MARKER, overwrite, what=WHAT)
    if not any(isinstance(m, QuantizedLinear) for m in model.modules()):
        raise ValueError("the model has no compressed linears; run quant.quantize_ first, or save a dense model "
                         "with quant.export_dense")
    state, qc = build_export(model)
    if not qc["config_groups"]:
        raise ValueError("no linear of this model has a layout compressed-tensors packs (INT8 per channel or "
                         "INT4 group-wise); use quant.save_compressed (specdec format) or quant.export_dense")
    hf_config = copy.deepcopy(model.config.hf_config)
    if "lm_head.weight" in state or "lm_head.weight_packed" in state:
        hf_config.tie_word_embeddings = False
    hf_config.dtype = str(model.dtype).removeprefix("torch.")
    hf_config.quantization_config = qc

    def write(tmp: Path) -> None:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        hf_config.to_json_file(str(tmp / "config.json"))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))

    meta = {"format": "compressed-tensors", "version": 1, "recipe": list(getattr(model, "compression_recipe", []))}
    return write_output_dir(out_dir, write, MARKER, meta, overwrite, what=WHAT)
