"""Read Medusa heads from a heads directory (safetensors + JSON), with checks against the model.

Loading is an online concern (`specdec eval --methods medusa:DIR`), so it lives in `specdec`;
`distill.medusa` writes these directories and re-exports `load_medusa`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from runtime.errors import CheckpointError
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
    if heads.vocab is not None:
        try:  # the stored guess vocabulary gets the checks restrict_vocab makes
            heads.restrict_vocab(heads.vocab)
        except ValueError as e:
            raise CheckpointError(f"{Path(path) / WEIGHTS}: its guess vocabulary is invalid ({e}); "
                                  "re-save the heads") from e
    return heads.to(device=model.device, dtype=dtype or model.dtype).eval().requires_grad_(False)
