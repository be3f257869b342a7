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
    """The model's linear layer `name`, which a compressed module of that name replaces; CheckpointError
    naming `path` (compression.json), the name and what it is when it is not a linear of the model."""
    try:
        module = model.get_submodule(name)
    except AttributeError:
        module = None
    if not isinstance(module, torch.nn.Linear):
        what = ("not a module of this model" if module is None
                else f"of type {type(module).__name__}, not a linear layer")
        raise CheckpointError(f"{path} lists compressed module {name!r}, which is {what}; compressed modules are "
                              f"the model's linear layers ({', '.join(_linear_examples(model))}, ...); the file is "
                              "corrupt or belongs to another model")
    return module


def _linear_examples(model: torch.nn.Module) -> list[str]:
    """The names of the model's first layer's linears and of its LM head, for messages."""
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
            and (n.startswith("layers.0.") or n == "lm_head")]


class _MissingTensor(KeyError):
    """A tensor a compressed module's format needs that the checkpoint does not hold."""


class _Tensors(dict):
    """A module's tensors; a missing one raises _MissingTensor (not a plain KeyError, which a missing
    field of its compression.json entry raises)."""

    def __missing__(self, key: str) -> torch.Tensor:
        raise _MissingTensor(key)


def _rebuild(name: str, mod_meta: dict[str, Any], local: dict[str, torch.Tensor], linear: torch.nn.Linear,
             path: Path) -> torch.nn.Module:
    """The compressed module `name` from its meta and tensors, checked against its meta's sizes and the
    linear it replaces."""
    fmt = mod_meta.get("format")
    try:
        module = from_tensors(mod_meta, _Tensors(local))
    except _MissingTensor as err:
        held = ", ".join(f"{name}.{k}" for k in sorted(local))
        raise CheckpointError(f"{path} lists {name!r} in format {fmt!r}, which needs the tensor {name}.{err.args[0]}, "
                              f"but {path.parent / 'model.safetensors'} holds {held}; {path.name} does not describe "
                              "these tensors") from err
    except KeyError as err:
        raise CheckpointError(f"{path}: compressed module {name!r} ({fmt!r}) lacks {err} in its entry; the file is "
                              "corrupt") from err
    except _MALFORMED as err:
        raise CheckpointError(f"{path}: compressed module {name!r} in format {fmt!r} is malformed "
                              f"({type(err).__name__}{': ' + str(err) if str(err) else ''}); {path.name} does not "
                              f"describe its tensors in {path.parent / 'model.safetensors'} "
                              f"({', '.join(f'{k} {tuple(v.shape)}' for k, v in local.items())})") from err
    got = (module.out_features, module.in_features)
    if got != tuple(linear.weight.shape):
        raise CheckpointError(f"compressed module {name} in {path.parent} is {got[0]} x {got[1]} (out x in), but "
                              f"the config implies {linear.out_features} x {linear.in_features}; the config does "
                              "not belong to these weights")
    said = (mod_meta.get("out_features", got[0]), mod_meta.get("in_features", got[1]))
    if said != got:
        raise CheckpointError(f"{path} says {name} is {said[0]} x {said[1]} (out x in), but its tensors hold "
                              f"{got[0]} x {got[1]}; the file does not describe these tensors")
    bias = None if module.bias is None else tuple(module.bias.shape)
    want = None if linear.bias is None else tuple(linear.bias.shape)
    if bias != want:
        raise CheckpointError(f"compressed module {name} in {path.parent} has bias {bias}, the model needs "
                              f"{want}; the checkpoint is corrupt")
    return module


def _check_unlisted(model: torch.nn.Module, dense: dict[str, torch.Tensor], meta_path: Path, weights: Path) -> None:
    """CheckpointError naming the tensors of `weights` that are neither a parameter of the model nor a
    module compression.json lists: the packed tensors of a module the file does not name (loading would
    drop them and then miss that module's weight)."""
    known = set(model.state_dict())
    stray = sorted(set(dense) - known)
    if stray:
        modules = sorted({k.rsplit(".", 1)[0] for k in stray})
        raise CheckpointError(f"{weights} holds {', '.join(stray[:4])}{' ...' if len(stray) > 4 else ''}, which "
                              f"are not tensors of the model, and {meta_path.name} lists no compressed module "
                              f"{', '.join(modules[:4])}; {meta_path} does not describe these weights")


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
    linears = {name: _linear(model, name, meta_path) for name in modules}
    _check_unlisted(model, dense, meta_path, weights)
    for name, mod_meta in modules.items():
        prefix = name + "."
        local = {k[len(prefix):]: v.to(device, copy=True) for k, v in tensors.items() if k.startswith(prefix)}
        if not local:
            raise CheckpointError(f"{ckpt} lists compressed module {name} but stores none of its tensors")
        model.set_submodule(name, _rebuild(name, mod_meta, local, linears[name], meta_path))
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
