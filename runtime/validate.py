"""Checks on a checkpoint's files, made before anything is built from them.

Loading trusts nothing it reads. JSON files must parse into objects (`read_json`); a checkpoint
that asks transformers to run its own code (`auto_map`) is refused before transformers reads it
(`refuse_remote_code`); the shards of a sharded index stay inside the checkpoint directory
(`safetensors_files`); and the tensor names, shapes and dtypes in the safetensors headers, read
without loading any data (`read_headers`), must agree with the config before a module is
allocated (`check_tensors`). So a config that says 100000 layers, or a vocabulary the weights do
not have, fails in milliseconds with a message naming the file, not after minutes of allocation.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, NamedTuple

import torch
from safetensors import SafetensorError, safe_open

from runtime.config import SUPPORTED_MODEL_TYPES, ModelConfig
from runtime.errors import CheckpointError, UnsupportedModelError

INDEX = "model.safetensors.index.json"
# files transformers reads `auto_map` (the checkpoint's own Python classes) from
REMOTE_CODE_FILES = ("config.json", "tokenizer_config.json")


class TensorInfo(NamedTuple):
    """What a header says about one tensor: shape, dtype name ("BF16", "int8", ...), floating or not."""

    shape: tuple[int, ...]
    dtype: str
    floating: bool


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path`; CheckpointError naming the file when it is unreadable or not an object."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError, RecursionError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(f"{path} cannot be read as JSON ({type(err).__name__}: {err}); the file is "
                              "corrupt or not JSON") from err
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} holds a JSON {type(data).__name__}, not an object; the file is corrupt")
    return data


def refuse_remote_code(ckpt: Path) -> None:
    """UnsupportedModelError when config.json or tokenizer_config.json of `ckpt` has an `auto_map`.

    transformers would import the Python files that key names (asking first in a terminal, where
    "y" runs them); specdec runs only its own code, so such a checkpoint is refused before
    transformers reads it.
    """
    for name in REMOTE_CODE_FILES:
        path = Path(ckpt) / name
        if path.is_file() and "auto_map" in (raw := read_json(path)):
            classes = raw["auto_map"]
            shown = ", ".join(f"{k} -> {v}" for k, v in classes.items()) if isinstance(classes, dict) else classes
            raise UnsupportedModelError(
                f"{path} has an 'auto_map' entry ({str(shown)[:200]}): the checkpoint asks to run its own "
                "Python code, and specdec never runs code shipped with a checkpoint. Use a checkpoint of a "
                f"family the runtime implements ({', '.join(SUPPORTED_MODEL_TYPES)}) without 'auto_map', "
                "or delete the key if transformers' built-in class is the one meant")


def model_config(hf_config: Any, ckpt: Path | str | None = None) -> ModelConfig:
    """ModelConfig.from_hf, its ValueErrors (sizes that are not positive integers, positions past
    runtime.config.MAX_POSITIONS, ...) turned into CheckpointErrors naming `ckpt`'s config.json."""
    try:
        return ModelConfig.from_hf(hf_config)
    except UnsupportedModelError:
        raise
    except ValueError as err:
        where = Path(ckpt) / "config.json" if ckpt is not None else "the model config"
        raise CheckpointError(f"{where} is invalid: {err}") from err


def shard_path(ckpt: Path, index: Path, shard: Any) -> Path:
    """The file `shard` (an entry of a sharded index) inside `ckpt`; CheckpointError when it is not
    a relative path that stays inside the directory."""
    if not isinstance(shard, str) or shard in ("", "."):
        raise CheckpointError(f"{index} lists shard {shard!r}, which is not a file name; the index is corrupt")
    rel = PurePosixPath(shard)
    if rel.is_absolute() or ".." in rel.parts:
        raise CheckpointError(f"{index} lists shard {shard!r}, a path outside the checkpoint directory; shard "
                              f"paths must be file names inside {ckpt}")
    return Path(ckpt) / rel


def safetensors_files(ckpt: Path) -> list[Path]:
    """The safetensors files of a checkpoint dir: the shards its index lists (each present and
    inside the directory), else every *.safetensors file; [] when there are none."""
    ckpt = Path(ckpt)
    index = ckpt / INDEX
    if not index.is_file():
        return sorted(ckpt.glob("*.safetensors"))
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index} has no 'weight_map' object (tensor name -> shard file); the index is "
                              "corrupt")
    files = [shard_path(ckpt, index, s) for s in dict.fromkeys(weight_map.values())]
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"{index} lists shard {f.relative_to(ckpt)}, which is missing from {ckpt}")
    return sorted(files)


def read_headers(files: Iterable[Path]) -> dict[str, TensorInfo]:
    """Name -> TensorInfo of every tensor in safetensors `files`, from their headers (no data is
    read); CheckpointError naming a file that does not parse."""
    infos: dict[str, TensorInfo] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as handle:
                for name in handle.keys():
                    part = handle.get_slice(name)
                    dtype = part.get_dtype()
                    infos[name] = TensorInfo(tuple(part.get_shape()), dtype, dtype.startswith(("F", "BF")))
        except (SafetensorError, OSError) as err:
            raise CheckpointError(f"{f} is corrupt or truncated ({err}); delete it and fetch or convert the "
                                  "checkpoint again") from err
    return infos


def tensor_infos(tensors: Mapping[str, torch.Tensor]) -> dict[str, TensorInfo]:
    """Name -> TensorInfo of tensors already in memory."""
    return {k: TensorInfo(tuple(t.shape), str(t.dtype).removeprefix("torch."), t.is_floating_point())
            for k, t in tensors.items()}


def check_finite(tensors: Mapping[str, torch.Tensor], source: Path | str) -> None:
    """CheckpointError naming the first floating tensor of `source` that holds NaN or inf."""
    for name, t in tensors.items():
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise CheckpointError(f"tensor {name} in {source} holds NaN or inf values; the checkpoint is corrupt")


# Sizes a tensor dimension may be, as config.json spells them -> how to compute them from a ModelConfig
_DIMS = {
    "vocab_size": lambda c: c.vocab_size,
    "hidden_size": lambda c: c.hidden_size,
    "intermediate_size": lambda c: c.intermediate_size,
    "2 * intermediate_size": lambda c: 2 * c.intermediate_size,
    "num_attention_heads * head_dim": lambda c: c.num_heads * c.head_dim,
    "num_key_value_heads * head_dim": lambda c: c.num_kv_heads * c.head_dim,
    "(num_attention_heads + 2 * num_key_value_heads) * head_dim": lambda c: c.qkv_size,
}


@dataclass(frozen=True)
class Layout:
    """Tensor names of one checkpoint layout and the shape of each, in config terms."""

    layer_prefix: str  # "model.layers." ; layer i's tensors are <layer_prefix><i>.<suffix>
    top: dict[str, tuple[str, ...]]
    layer: dict[str, tuple[str, ...]]

    def layer_index(self, name: str) -> tuple[int, str] | None:
        """(i, suffix) of a per-layer tensor name, None for any other name."""
        m = re.match(re.escape(self.layer_prefix) + r"(\d+)\.(.+)", name)
        return (int(m.group(1)), m.group(2)) if m else None


_QKV = ("num_attention_heads * head_dim", "num_key_value_heads * head_dim", "num_key_value_heads * head_dim")
HF_LAYOUT = Layout(
    "model.layers.",
    {"model.embed_tokens.weight": ("vocab_size", "hidden_size"), "model.norm.weight": ("hidden_size",),
     "lm_head.weight": ("vocab_size", "hidden_size")},
    {"input_layernorm.weight": ("hidden_size",), "post_attention_layernorm.weight": ("hidden_size",),
     **{f"self_attn.{p}_proj.weight": (size, "hidden_size") for p, size in zip("qkv", _QKV)},
     **{f"self_attn.{p}_proj.bias": (size,) for p, size in zip("qkv", _QKV)},
     "self_attn.o_proj.weight": ("hidden_size", "num_attention_heads * head_dim"),
     "mlp.gate_proj.weight": ("intermediate_size", "hidden_size"),
     "mlp.up_proj.weight": ("intermediate_size", "hidden_size"),
     "mlp.down_proj.weight": ("hidden_size", "intermediate_size")})
# runtime.Transformer's own parameter names (what a compressed checkpoint stores dense)
RUNTIME_LAYOUT = Layout(
    "layers.",
    {"embed.weight": ("vocab_size", "hidden_size"), "norm.weight": ("hidden_size",),
     "lm_head.weight": ("vocab_size", "hidden_size")},
    {"attn_norm.weight": ("hidden_size",), "mlp_norm.weight": ("hidden_size",),
     "attn.wqkv.weight": ("(num_attention_heads + 2 * num_key_value_heads) * head_dim", "hidden_size"),
     "attn.wqkv.bias": ("(num_attention_heads + 2 * num_key_value_heads) * head_dim",),
     "attn.wo.weight": ("hidden_size", "num_attention_heads * head_dim"),
     "mlp.w13.weight": ("2 * intermediate_size", "hidden_size"),
     "mlp.w2.weight": ("hidden_size", "intermediate_size")})


def _config_file(where: Path | str | None) -> str:
    return f"{Path(where) / 'config.json'}" if where is not None else "the config"


def _weights(where: Path | str | None) -> str:
    return f"the weights in {where}" if where is not None else "the weights"


def layer_span(indices: list[int]) -> str:
    """'2 layers (0..1)', 'no decoder layers', or '3 layers with gaps (0, 1, 5)' for sorted layer indices."""
    if not indices:
        return "no decoder layers"
    if indices == list(range(indices[0], indices[-1] + 1)):
        return f"{len(indices)} layers ({indices[0]}..{indices[-1]})"
    shown = ", ".join(map(str, indices[:8])) + (", ..." if len(indices) > 8 else "")
    return f"{len(indices)} layers with gaps ({shown})"


def check_layer_count(cfg: ModelConfig, names: Iterable[str], layout: Layout = HF_LAYOUT,
                      where: Path | str | None = None) -> None:
    """CheckpointError unless the tensors `names` hold exactly layers 0 .. cfg.num_layers - 1."""
    present = sorted({hit[0] for n in names if (hit := layout.layer_index(n)) is not None})
    if present != list(range(cfg.num_layers)):
        raise CheckpointError(f"{_config_file(where)} says num_hidden_layers={cfg.num_layers}, but "
                              f"{_weights(where)} hold {layer_span(present)}; the config does not belong to "
                              "these weights")


def check_shapes(cfg: ModelConfig, tensors: Mapping[str, TensorInfo], layout: Layout = HF_LAYOUT,
                 where: Path | str | None = None) -> None:
    """CheckpointError for a tensor the model uses whose shape differs from what the config implies
    (naming the config keys), or that is stored as an integer type (the model's weights are
    floating point; casting integer codes would silently change them)."""
    for name, info in tensors.items():
        hit = layout.layer_index(name)
        dims = layout.layer.get(hit[1]) if hit is not None else layout.top.get(name)
        if dims is None:
            continue  # not a tensor the model loads
        if not info.floating:
            raise CheckpointError(f"tensor {name} in {where or 'the checkpoint'} is stored as {info.dtype}, an "
                                  "integer type; the model needs floating-point weights (a quantized checkpoint "
                                  "must be one written by quant.save_compressed)")
        expected = tuple(_DIMS[d](cfg) for d in dims)
        if info.shape != expected:
            implied = ", ".join(f"{d}={v}" for d, v in zip(dims, expected))
            raise CheckpointError(f"tensor {name} in {where or 'the checkpoint'} has shape {info.shape}, but "
                                  f"{_config_file(where)} implies {expected} ({implied}); the config does not "
                                  "belong to these weights")


def check_tensors(cfg: ModelConfig, tensors: Mapping[str, TensorInfo], layout: Layout = HF_LAYOUT,
                  where: Path | str | None = None) -> None:
    """`check_layer_count` then `check_shapes`: the config agrees with the tensors before a module
    is built (cost: one pass over the names, whatever sizes the config claims)."""
    check_layer_count(cfg, tensors, layout, where)
    check_shapes(cfg, tensors, layout, where)
