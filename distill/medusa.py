"""Attach Medusa heads to a model, save them (safetensors + JSON), load them back with checks.

A heads directory holds `medusa.safetensors` (the residual blocks, plus the per-head LM heads
when they are not shared) and `medusa_config.json` (shapes, the shared-LM-head mode, the
candidate tree and the per-head accuracy it was built from). Both are written atomically.
The shared LM head is never saved: it is the base model's own `lm_head`.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from runtime.errors import CheckpointError
from specdec.medusa import MedusaConfig, MedusaHeads

WEIGHTS = "medusa.safetensors"
CONFIG = "medusa_config.json"


def attach_medusa(model, num_heads: int = 4, num_layers: int = 1, shared_lm_head: bool = True,
                  tree=None) -> MedusaHeads:
    """New (zero-initialised) Medusa heads for `model`, float32, on the model's device.

    shared_lm_head: use the base model's frozen LM head for every head (default; these models'
    vocabularies make a separate LM head per head larger than the model). False gives each head
    its own trainable copy of it. tree: candidate paths (default: the shipped tree).
    """
    cfg = model.config
    config = MedusaConfig(cfg.hidden_size, cfg.vocab_size, num_heads=num_heads, num_layers=num_layers,
                          shared_lm_head=shared_lm_head,
                          tree=tuple(tuple(p) for p in tree) if tree is not None else None)
    heads = MedusaHeads(config, model.lm_head)
    return heads.to(device=model.device, dtype=torch.float32)


def _atomic_write(path: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def save_medusa(heads: MedusaHeads, path: str | Path) -> Path:
    """Write the heads to directory `path` (created if needed); returns it. The current tree
    (`heads.tree`) is stored in the config."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = MedusaConfig(**{**heads.config.__dict__, "tree": heads.tree.paths})
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in heads.state_dict().items()}
    _atomic_write(path / WEIGHTS, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))

    def write_json(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump({"format": "specdec-medusa", "version": 1, **config.to_dict()}, f, indent=1)

    _atomic_write(path / CONFIG, write_json)
    return path


def read_medusa_config(path: str | Path) -> MedusaConfig:
    """The MedusaConfig stored in a heads directory (CheckpointError when it is not one)."""
    path = Path(path)
    cfg_file = path / CONFIG
    if not cfg_file.is_file() or not (path / WEIGHTS).is_file():
        raise CheckpointError(f"{path} is not a Medusa heads directory: it needs {CONFIG} and "
                              f"{WEIGHTS} (written by distill.save_medusa / specdec medusa train)")
    with open(cfg_file) as f:
        raw = json.load(f)
    if raw.get("format") != "specdec-medusa":
        raise CheckpointError(f"{cfg_file} is not a specdec Medusa config (format "
                              f"{raw.get('format')!r}); re-save the heads with distill.save_medusa")
    try:
        return MedusaConfig.from_dict(raw)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{cfg_file} is malformed ({e}); re-save the heads") from e


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
    heads = MedusaHeads(config, model.lm_head)
    state = load_file(str(Path(path) / WEIGHTS))
    expected = set(heads.state_dict())
    if set(state) != expected:
        missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
        raise CheckpointError(f"{Path(path) / WEIGHTS} does not match its config (missing "
                              f"{missing[:3]}, unexpected {extra[:3]}); the files are from different "
                              "saves")
    for name, t in heads.state_dict().items():
        if state[name].shape != t.shape:
            raise CheckpointError(f"{name} in {path} has shape {tuple(state[name].shape)}, the config "
                                  f"says {tuple(t.shape)}; the files are from different saves")
    heads.load_state_dict(state)
    return heads.to(device=model.device, dtype=dtype or model.dtype).eval().requires_grad_(False)
