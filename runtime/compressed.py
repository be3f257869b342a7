"""load_compressed: rebuild a Transformer from a checkpoint written by `quant.save_compressed`.

The directory holds config.json, model.safetensors (packed tensors of every compressed linear
under `<module>.<tensor>`, dense tensors under their runtime names) and compression.json:
{"format_version", "recipe", "modules": {name: runtime.qlinear meta}}. Packed tensors are
loaded as stored (no re-quantization), so a save/load round trip is bit-exact.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from runtime.errors import CheckpointError
from runtime.model import Transformer
from runtime.qlinear import from_tensors
from runtime.validate import (
    RUNTIME_LAYOUT,
    check_finite,
    check_layer_count,
    check_shapes,
    model_config,
    read_json,
    tensor_infos,
)

FORMAT_VERSION = 1
# what rebuilding a compressed module from malformed meta or tensors can raise (missing keys, wrong
# types, a group size of 0, shapes the packing ops reject)
_MALFORMED = (KeyError, ValueError, TypeError, AttributeError, IndexError, ZeroDivisionError, RuntimeError)


def read_compression_meta(ckpt: Path) -> dict[str, Any]:
    """compression.json of `ckpt`, checked for a format version this code can read and for its
    structure (a `modules` object of per-module objects, a `recipe` list)."""
    path = ckpt / "compression.json"
    meta = read_json(path)
    version = meta.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise CheckpointError(f"{path} has no valid format_version (got {version!r}); it was not written by "
                              "quant.save_compressed")
    if version > FORMAT_VERSION:
        raise CheckpointError(f"{ckpt} uses compressed-checkpoint format version {version}, newer than the "
                              f"version {FORMAT_VERSION} this specdec reads; upgrade specdec, or re-create the "
                              "checkpoint with this version")
    modules = meta.get("modules")
    if not isinstance(modules, dict):
        raise CheckpointError(f"{path} lacks the 'modules' table of compressed linears")
    for name, mod_meta in modules.items():
        if not isinstance(mod_meta, dict):
            raise CheckpointError(f"{path}: the entry of compressed module {name!r} is a JSON "
                                  f"{type(mod_meta).__name__}, not an object; the file is corrupt")
    if not isinstance(meta.get("recipe", []), list):
        raise CheckpointError(f"{path}: 'recipe' must be a list of compression steps, got {meta['recipe']!r}")
    return meta


def _linear(model: torch.nn.Module, name: str, path: Path) -> torch.nn.Linear:
    """The model's linear layer `name`, which a compressed module of that name replaces."""
    try:
        module = model.get_submodule(name)
    except AttributeError:
        module = None
    if not isinstance(module, torch.nn.Linear):
        raise CheckpointError(f"{path} lists compressed module {name!r}, which is not a linear layer of this "
                              "model; the file is corrupt or belongs to another model")
    return module


def _rebuild(name: str, mod_meta: dict[str, Any], local: dict[str, torch.Tensor], linear: torch.nn.Linear,
             path: Path) -> torch.nn.Module:
    """The compressed module `name` from its meta and tensors, checked against the linear it replaces."""
    try:
        module = from_tensors(mod_meta, local)
    except _MALFORMED as err:
        raise CheckpointError(f"compressed module {name} in {path.parent} is malformed ({type(err).__name__}: "
                              f"{err}); check {path.name} and model.safetensors") from err
    got = (module.out_features, module.in_features)
    if got != tuple(linear.weight.shape):
        raise CheckpointError(f"compressed module {name} in {path.parent} is {got[0]} x {got[1]} (out x in), but "
                              f"the config implies {linear.out_features} x {linear.in_features}; the config does "
                              "not belong to these weights")
    bias = None if module.bias is None else tuple(module.bias.shape)
    want = None if linear.bias is None else tuple(linear.bias.shape)
    if bias != want:
        raise CheckpointError(f"compressed module {name} in {path.parent} has bias {bias}, the model needs "
                              f"{want}; the checkpoint is corrupt")
    return module


def load_compressed(ckpt: Path, hf_config: Any, dtype: torch.dtype = torch.bfloat16,
                    device: torch.device | str = "cpu", attention: str | None = None) -> Transformer:
    """The Transformer of a compressed checkpoint dir; dense tensors in `dtype`, packed ones as stored.

    Before the model is built the tensors are checked against the config (layer count, dense
    shapes and floating dtypes: `runtime.validate`) and for NaN / inf; each compressed module
    against the linear layer it replaces.
    """
    ckpt = Path(ckpt)
    meta = read_compression_meta(ckpt)
    modules, meta_path, weights = meta["modules"], ckpt / "compression.json", ckpt / "model.safetensors"
    try:
        tensors = load_file(weights)
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{weights} cannot be read ({err}); the checkpoint is corrupt or incomplete") from err
    cfg = model_config(hf_config, ckpt)
    quantized_prefixes = tuple(n + "." for n in modules)
    dense = {k: v for k, v in tensors.items() if not k.startswith(quantized_prefixes)}
    check_layer_count(cfg, tensors, RUNTIME_LAYOUT, ckpt)
    check_shapes(cfg, tensor_infos(dense), RUNTIME_LAYOUT, ckpt)
    check_finite(tensors, weights)
    with torch.device("meta"):
        model = Transformer(cfg, attention=attention)
    for name, mod_meta in modules.items():
        linear = _linear(model, name, meta_path)
        prefix = name + "."
        local = {k[len(prefix):]: v.to(device, copy=True) for k, v in tensors.items() if k.startswith(prefix)}
        if not local:
            raise CheckpointError(f"{ckpt} lists compressed module {name} but stores none of its tensors")
        model.set_submodule(name, _rebuild(name, mod_meta, local, linear, meta_path))
    # copies, not views of the file's memory map: a view keeps every page of the file resident
    # (as `runtime.loading` does for dense checkpoints), beside what the modules derive from it
    dense = {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype, copy=True)
             for k, v in dense.items()}
    tie = cfg.tie_word_embeddings and "lm_head" not in modules
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
