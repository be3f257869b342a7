"""YAML recipes: an ordered list of compression configs plus calibration settings, and applying them.

A recipe file is either a list of configs or a mapping with `steps` (that list) and an
optional `calibration` block (source, n_samples, seq_len, one_per_text: each window from the
start of its own text, see quant.calibration_batches):

    calibration: {source: sharegpt, n_samples: 64, seq_len: 512, one_per_text: true}
    steps:
      - {type: SemiStructured24, method: sparsegpt}
      - {type: Int8WeightOnly, modules: ["*.attn.*"]}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn

from quant.api import quantize_, sparsify_
from quant.config import Config, SemiStructured24, config_from_dict

CALIBRATION_KEYS = {"source", "n_samples", "seq_len", "one_per_text"}


@dataclass(frozen=True)
class Recipe:
    """Configs applied in order; calibration arguments for quant.calibration_batches."""

    steps: tuple[Config, ...]
    calibration: dict[str, Any] = field(default_factory=lambda: {"source": "sharegpt", "n_samples": 128,
                                                                  "seq_len": 512})

    def __post_init__(self) -> None:
        if not self.steps:
            raise ValueError("a recipe needs at least one step")
        unknown = set(self.calibration) - CALIBRATION_KEYS
        if unknown:
            raise ValueError(f"unknown calibration keys {sorted(unknown)}; valid: {sorted(CALIBRATION_KEYS)}")

    @property
    def needs_calibration(self) -> bool:
        return any(getattr(s, "method", "rtn") not in ("rtn", "magnitude") for s in self.steps)


def load_recipe(path: str | Path) -> Recipe:
    """Parse a YAML recipe file (see the module docstring); errors name the file and the problem."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"recipe {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ValueError(f"recipe {path} is not valid YAML ({err})") from err
    if isinstance(data, list):
        data = {"steps": data}
    if not isinstance(data, dict) or not isinstance(data.get("steps"), list):
        raise ValueError(f"recipe {path} must be a list of configs or a mapping with a 'steps' list")
    calibration = {"source": "sharegpt", "n_samples": 128, "seq_len": 512, **(data.get("calibration") or {})}
    try:
        return Recipe(tuple(config_from_dict(s) for s in data["steps"]), calibration)
    except ValueError as err:
        raise ValueError(f"recipe {path}: {err}") from err


def apply_recipe(model: nn.Module, recipe: Recipe, calibration: torch.Tensor | None,
                 progress: bool = True) -> nn.Module:
    """Run every step of `recipe` on `model` in order (in place)."""
    for step in recipe.steps:
        verb = sparsify_ if isinstance(step, SemiStructured24) else quantize_
        verb(model, step, calibration=calibration, progress=progress)
    return model
