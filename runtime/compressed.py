"""load_compressed: rebuild a Transformer from a checkpoint written by `quant.save_compressed`.

The directory holds config.json, model.safetensors (packed tensors of every compressed linear
under `<module>.<tensor>`, dense tensors under their runtime names) and compression.json:
{"format_version", "recipe", "modules": {name: runtime.qlinear meta}}. Packed tensors are
loaded as stored (no re-quantization), so a save/load round trip is bit-exact.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from runtime.config import ModelConfig
from runtime.errors import CheckpointError
from runtime.model import Transformer
from runtime.qlinear import from_tensors

FORMAT_VERSION = 1


def read_compression_meta(ckpt: Path) -> dict[str, Any]:
    """compression.json of `ckpt`, checked for a format version this code can read."""
    path = ckpt / "compression.json"
    try:
        meta = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path} cannot be read as JSON ({err}); the checkpoint is corrupt") from err
    version = meta.get("format_version")
    if not isinstance(version, int) or version < 1:
        raise CheckpointError(f"{path} has no valid format_version (got {version!r}); it was not written by "
                              "quant.save_compressed")
    if version > FORMAT_VERSION:
        raise CheckpointError(f"{ckpt} uses compressed-checkpoint format version {version}, newer than the "
                              f"version {FORMAT_VERSION} this specdec reads; upgrade specdec, or re-create the "
                              "checkpoint with this version")
    if not isinstance(meta.get("modules"), dict):
        raise CheckpointError(f"{path} lacks the 'modules' table of compressed linears")
    return meta


def _set_module(model: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def load_compressed(ckpt: Path, hf_config: Any, dtype: torch.dtype = torch.bfloat16,
                    device: torch.device | str = "cpu", attention: str | None = None) -> Transformer:
    """The Transformer of a compressed checkpoint dir; dense tensors in `dtype`, packed ones as stored."""
    ckpt = Path(ckpt)
    meta = read_compression_meta(ckpt)
    try:
        tensors = load_file(ckpt / "model.safetensors")
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{ckpt / 'model.safetensors'} cannot be read ({err}); the checkpoint is corrupt "
                              "or incomplete") from err
    cfg = ModelConfig.from_hf(hf_config)
    with torch.device("meta"):
        model = Transformer(cfg, attention=attention)
    for name, mod_meta in meta["modules"].items():
        prefix = name + "."
        local = {k[len(prefix):]: v.to(device) for k, v in tensors.items() if k.startswith(prefix)}
        if not local:
            raise CheckpointError(f"{ckpt} lists compressed module {name} but stores none of its tensors")
        try:
            module = from_tensors(mod_meta, local)
        except (KeyError, ValueError) as err:
            raise CheckpointError(f"compressed module {name} in {ckpt} is malformed ({err})") from err
        _set_module(model, name, module)
    quantized_prefixes = tuple(n + "." for n in meta["modules"])
    dense = {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype)
             for k, v in tensors.items() if not k.startswith(quantized_prefixes)}
    tie = cfg.tie_word_embeddings and "lm_head" not in meta["modules"]
    if tie:
        dense.pop("lm_head.weight", None)
    model.load_state_dict(dense, assign=True, strict=False)
    if tie:
        model.lm_head.weight = model.embed.weight
    missing = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if missing:
        raise CheckpointError(f"{ckpt} lacks {len(missing)} tensors the model needs, e.g. {', '.join(missing[:4])}")
    model.compression_recipe = list(meta.get("recipe", []))
    return model.eval().requires_grad_(False)
