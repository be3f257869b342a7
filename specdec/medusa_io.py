"""Read Medusa heads from a heads directory (safetensors + JSON), with checks against the model.

Loading is an online concern (`specdec eval --methods medusa:DIR`), so it lives in `specdec`;
`distill.medusa` writes these directories and re-exports `load_medusa`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from runtime.errors import CheckpointError
from runtime.validate import TensorInfo, check_finite, read_headers, read_json
from specdec.medusa import MedusaConfig, MedusaHeads

WEIGHTS = "medusa.safetensors"
CONFIG = "medusa_config.json"


def read_medusa_config(path: str | Path) -> MedusaConfig:
    """The MedusaConfig stored in a heads directory (CheckpointError when it is not one)."""
    path = Path(path)
    cfg_file = path / CONFIG
    if not cfg_file.is_file() or not (path / WEIGHTS).is_file():
        raise CheckpointError(f"{path} is not a Medusa heads directory: it needs {CONFIG} and "
                              f"{WEIGHTS} (written by distill.save_medusa / specdec medusa train)")
    raw = read_json(cfg_file)
    if raw.get("format") != "specdec-medusa":
        raise CheckpointError(f"{cfg_file} is not a specdec Medusa config (format "
                              f"{raw.get('format')!r}); re-save the heads with distill.save_medusa")
    try:
        return MedusaConfig.from_dict(raw)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, ZeroDivisionError, OverflowError) as e:
        raise CheckpointError(f"{cfg_file} is malformed ({type(e).__name__}: {e}); re-save the heads") from e


def _indices(names: Iterable[str], pattern: str) -> list[int]:
    return sorted({int(m.group(1)) for n in names if (m := re.match(pattern, n))})


def _count(indices: list[int], what: str) -> str:
    if indices == list(range(len(indices))):
        return f"{len(indices)} {what}"
    return f"{what} {', '.join(map(str, indices[:8]))}{', ...' if len(indices) > 8 else ''}"


def check_medusa_tensors(config: MedusaConfig, tensors: Mapping[str, TensorInfo], path: str | Path) -> None:
    """CheckpointError unless the tensors (from the safetensors header of heads directory `path`)
    are exactly those `MedusaHeads(config)` holds, with its shapes and dtypes: the heads and
    layers counted first, so a config that claims 20000 heads fails before any is built."""
    weights = Path(path) / WEIGHTS
    for key, pattern, what, want in (("num_heads", r"blocks\.(\d+)\.", "heads", config.num_heads),
                                     ("num_layers", r"blocks\.\d+\.(\d+)\.", "layers per head",
                                      config.num_layers)):
        present = _indices(tensors, pattern)
        if present != list(range(want)):
            raise CheckpointError(f"{Path(path) / CONFIG} says {key}={want}, but {weights} holds "
                                  f"{_count(present, what)}; the files are from different saves")
    C, V = config.hidden_size, config.vocab_size
    expected: dict[str, tuple[int, ...]] = {}
    for i in range(config.num_heads):
        for j in range(config.num_layers):
            expected[f"blocks.{i}.{j}.linear.weight"] = (C, C)
            expected[f"blocks.{i}.{j}.linear.bias"] = (C,)
        if not config.shared_lm_head:
            expected[f"lm_heads.{i}.weight"] = (V, C)
    if config.guess_vocab:
        expected["vocab"] = (config.guess_vocab,)
    if set(tensors) != set(expected):
        missing, extra = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
        raise CheckpointError(f"{weights} does not match its config (missing {missing[:3]}, unexpected "
                              f"{extra[:3]}); the files are from different saves")
    for name, shape in expected.items():
        info = tensors[name]
        if info.shape != shape:
            raise CheckpointError(f"{name} in {weights} has shape {info.shape}, the config says {shape}; the "
                                  "files are from different saves")
        if info.floating == (name == "vocab"):  # token ids are integers, weights floating point
            raise CheckpointError(f"{name} in {weights} is stored as {info.dtype}; re-save the heads")


def load_medusa(path: str | Path, model, dtype: torch.dtype | None = None,
                shared_lm_head: bool | None = None) -> MedusaHeads:
    """Load heads saved by `save_medusa` for `model` (on its device, in `dtype`, default the
    model's). Fails with CheckpointError when the heads were trained for another hidden size or
    vocabulary, or when `shared_lm_head` is given and differs from the saved mode."""
    config = read_medusa_config(path)
    cfg = model.config
    if config.hidden_size != cfg.hidden_size:
        raise CheckpointError(f"the Medusa heads in {path} expect hidden size {config.hidden_size}, "
                              f"the model has {cfg.hidden_size}: they were trained for another model")
    if config.vocab_size != cfg.vocab_size:
        raise CheckpointError(f"the Medusa heads in {path} expect a vocabulary of {config.vocab_size} "
                              f"tokens, the model has {cfg.vocab_size}: they were trained for another "
                              "model (or tokenizer)")
    if shared_lm_head is not None and shared_lm_head != config.shared_lm_head:
        raise CheckpointError(f"the Medusa heads in {path} were saved with shared_lm_head="
                              f"{config.shared_lm_head}, but shared_lm_head={shared_lm_head} was asked "
                              "for; drop the argument or load other heads")
    weights = Path(path) / WEIGHTS
    check_medusa_tensors(config, read_headers([weights]), path)  # before any head is built
    try:
        state = load_file(str(weights))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{weights} is corrupt or truncated ({e}); re-save the heads") from e
    check_finite(state, weights)
    heads = MedusaHeads(config, model.lm_head)
    heads.load_state_dict(state)
    if heads.vocab is not None:
        try:  # the stored guess vocabulary gets the checks restrict_vocab makes
            heads.restrict_vocab(heads.vocab)
        except ValueError as e:
            raise CheckpointError(f"{Path(path) / WEIGHTS}: its guess vocabulary is invalid ({e}); "
                                  "re-save the heads") from e
    return heads.to(device=model.device, dtype=dtype or model.dtype).eval().requires_grad_(False)
