"""save_compressed / export_dense: compressed checkpoints (packed safetensors + compression.json) and
plain Hugging Face exports (+ specdec_export.json), written atomically (a temporary directory renamed
into place).

Both follow runtime.output_paths' rule: the output directory must be new, empty, or, with
`overwrite=True`, a previous output of the same kind that holds nothing else; a file, or a
directory specdec did not write, is refused (OutputPathError) and never touched.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from quant.compressed_tensors import save_compressed_tensors
from runtime.args import check_bool, check_instance, check_methods, check_module
from runtime.compressed import FORMAT_VERSION
from runtime.hf_state import dense_hf_state, is_tied
from runtime.output_paths import prepare_output_dir, write_output_dir
from runtime.qlinear import QuantizedLinear

COMPRESSED_MARKER, COMPRESSED = "compression.json", "compressed checkpoint"
EXPORT_MARKER, EXPORT = "specdec_export.json", "dense export"


def compressed_modules(model: nn.Module) -> dict[str, QuantizedLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}


def model_nbytes(model: nn.Module) -> int:
    """Bytes of all parameters and buffers, a tensor shared by two modules counted once."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def dir_nbytes(path: str | Path) -> int:
    """Bytes of the weight files (*.safetensors) in a checkpoint directory."""
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))


def check_compressed_out(out_dir: str | Path, overwrite: bool = False) -> Path:
    """Fail now (OutputPathError) when save_compressed could not write `out_dir`; call before compressing."""
    return prepare_output_dir(out_dir, COMPRESSED_MARKER, overwrite, what=COMPRESSED)


def check_export_out(out_dir: str | Path, overwrite: bool = False) -> Path:
    """Fail now (OutputPathError) when export_dense could not write `out_dir`."""
    return prepare_output_dir(out_dir, EXPORT_MARKER, overwrite, what=EXPORT)


def _check_save_args(model: Any, out_dir: Any, tokenizer: Any, overwrite: Any) -> None:
    """TypeError naming the argument of save_compressed / export_dense that has the wrong type."""
    check_module("model", model, "a model compressed by quant.quantize_ / quant.sparsify_")
    check_instance("out_dir", out_dir, (str, os.PathLike), "a directory path (a str or a Path)")
    if tokenizer is not None:
        check_methods("tokenizer", tokenizer, ["save_pretrained"], "a tokenizer (runtime.load_tokenizer) or None")
    check_bool("overwrite", overwrite)


def _write_common(tmp: Path, hf_config: Any, tokenizer: Any) -> None:
    hf_config.to_json_file(str(tmp / "config.json"))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp))


FORMATS = ("specdec", "compressed-tensors")


def save_compressed(model: nn.Module, out_dir: str | Path, tokenizer: Any = None, overwrite: bool = False,
                    format: str = "specdec") -> Path:
    """Write `model` (compressed by quantize_ / sparsify_) to `out_dir`; `runtime.load_model(out_dir)` restores it.

    format "specdec" (default) files: model.safetensors (packed tensors `<module>.<name>`, dense
    tensors by runtime name), compression.json (format version, the recipe, per-module formats, the
    list of files), config.json and the tokenizer when given; every format round-trips bit-exactly.
    format "compressed-tensors": a pack-quantized Hugging Face checkpoint that transformers and vLLM
    load too (INT8 / INT4 only; see `quant.compressed_tensors`). `out_dir` must be new or empty;
    `overwrite=True` replaces a previous output of the same format there (and nothing else).
    """
    _check_save_args(model, out_dir, tokenizer, overwrite)
    if format not in FORMATS:
        raise ValueError(f"save_compressed format must be one of {FORMATS}, got {format!r}")
    if format == "compressed-tensors":
        return save_compressed_tensors(model, out_dir, tokenizer=tokenizer, overwrite=overwrite)
    check_compressed_out(out_dir, overwrite)
    qmods = compressed_modules(model)
    if not qmods:
        raise ValueError("the model has no compressed linears; run quant.quantize_ or quant.sparsify_ first, "
                         "or save a dense model with export_dense")
    tensors: dict[str, torch.Tensor] = {}
    for name, mod in qmods.items():
        for key, t in mod.to_tensors().items():
            tensors[f"{name}.{key}"] = t
    prefixes = tuple(n + "." for n in qmods)
    for key, t in model.state_dict().items():
        if key.startswith(prefixes) or (key == "lm_head.weight" and is_tied(model)):
            continue
        tensors[key] = t
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    meta = {"format_version": FORMAT_VERSION, "recipe": list(getattr(model, "compression_recipe", [])),
            "dtype": str(model.dtype).removeprefix("torch."),
            "modules": {name: mod.meta() for name, mod in qmods.items()}}

    def write(tmp: Path) -> None:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        _write_common(tmp, model.config.hf_config, tokenizer)

    return write_output_dir(out_dir, write, COMPRESSED_MARKER, meta, overwrite, what=COMPRESSED)


def export_dense(model: nn.Module, out_dir: str | Path, tokenizer: Any = None,
                 dtype: torch.dtype | None = None, overwrite: bool = False) -> Path:
    """Write a plain Hugging Face checkpoint (dequantized weights) that `transformers` loads.

    specdec_export.json marks the directory as specdec's (the recipe, the dtype, the list of
    files); `out_dir` must be new or empty, and `overwrite=True` replaces a dense export there.
    """
    _check_save_args(model, out_dir, tokenizer, overwrite)
    check_export_out(out_dir, overwrite)
    state = dense_hf_state(model, dtype)
    hf_config = copy.deepcopy(model.config.hf_config)
    if "lm_head.weight" in state:
        hf_config.tie_word_embeddings = False
    hf_config.torch_dtype = str(dtype or model.dtype).removeprefix("torch.")

    def write(tmp: Path) -> None:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        _write_common(tmp, hf_config, tokenizer)

    meta = {"format": "specdec-dense-export", "version": 1, "dtype": hf_config.torch_dtype,
            "recipe": list(getattr(model, "compression_recipe", []))}
    return write_output_dir(out_dir, write, EXPORT_MARKER, meta, overwrite, what=EXPORT)
