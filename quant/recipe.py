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
from quant.config import Config, SemiStructured24, config_from_dict, unknown_keys

RECIPE_KEYS = ("steps", "calibration")
DEFAULT_CALIBRATION = {"source": "sharegpt", "n_samples": 128, "seq_len": 512}
# key -> (the check of its value, what the message says it must be)
CALIBRATION_KEYS = {
    "source": (lambda v: isinstance(v, (str, Path)) and str(v) != "" or hasattr(v, "column_names"),
               "'sharegpt', 'code', 'sharegpt+code', a .jsonl path or a datasets.Dataset"),
    "n_samples": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "an integer >= 1"),
    "seq_len": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 2, "an integer >= 2"),
    "one_per_text": (lambda v: isinstance(v, bool), "true or false"),
}


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a mapping key written twice (plain YAML keeps the last one, so a
    second `steps:` would silently drop the first); keys a `<<` merge brings in may be overridden."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        lines: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                if key in lines:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} is written twice (first at line {lines[key]}); write each key once",
                        key_node.start_mark)
                lines[key] = key_node.start_mark.line + 1
            except TypeError:  # an unhashable key: SafeLoader's own error names it
                continue
        return super().construct_mapping(node, deep)


def _yaml_error(err: yaml.YAMLError) -> str:
    """A YAML error in one line: the problem and where it is (PyYAML's own text spans several)."""
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None)
    if mark is None or problem is None:
        return " ".join(str(err).split())
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"


def _read_yaml(path: Path) -> Any:
    """The YAML document in file `path`; ValueError naming the file when it is a directory, cannot be
    read, is not UTF-8 text or not valid YAML, FileNotFoundError when it does not exist."""
    if path.is_dir():
        raise ValueError(f"recipe {path} is a directory; give the recipe's YAML file")
    if not path.is_file():
        raise FileNotFoundError(f"recipe {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"recipe {path} is not a UTF-8 text file ({err.reason} at byte {err.start}); give a YAML "
                         "recipe") from None
    except OSError as err:
        raise ValueError(f"recipe {path} cannot be read ({err.strerror}); give a readable YAML file") from None
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as err:
        raise ValueError(f"recipe {path} is not valid YAML: {_yaml_error(err)}") from err


def check_calibration(calibration: Any) -> None:
    """ValueError naming an unknown key (and the closest known one) or a bad value of a recipe's
    `calibration` mapping (the keyword arguments of quant.calibration_batches)."""
    if not isinstance(calibration, dict):
        raise ValueError(f"calibration must be a mapping of {', '.join(CALIBRATION_KEYS)}, got {calibration!r}")
    unknown_keys("calibration", calibration, CALIBRATION_KEYS)
    for key, value in calibration.items():
        check, wanted = CALIBRATION_KEYS[key]
        if not check(value):
            raise ValueError(f"calibration.{key} must be {wanted}, got {value!r}")


@dataclass(frozen=True)
class Recipe:
    """Configs applied in order; calibration arguments for quant.calibration_batches."""

    steps: tuple[Config, ...]
    calibration: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_CALIBRATION))

    def __post_init__(self) -> None:
        if not self.steps:
            raise ValueError("a recipe needs at least one step")
        check_calibration(self.calibration)

    @property
    def needs_calibration(self) -> bool:
        return any(getattr(s, "method", "rtn") not in ("rtn", "magnitude") for s in self.steps)


def load_recipe(path: str | Path) -> Recipe:
    """Parse a YAML recipe file (see the module docstring). Unknown keys, at the top, in `calibration`
    and in each step, are refused by name (with the closest allowed key); errors name the file, the
    step and the problem."""
    path = Path(path)
    data = _read_yaml(path)
    if isinstance(data, list):
        data = {"steps": data}
    if not isinstance(data, dict) or not isinstance(data.get("steps"), list):
        raise ValueError(f"recipe {path} must be a list of configs or a mapping with a 'steps' list")
    try:
        unknown_keys("top level", data, RECIPE_KEYS)
        steps = []
        for i, step in enumerate(data["steps"]):
            try:
                steps.append(config_from_dict(step))
            except (ValueError, TypeError) as err:
                raise ValueError(f"step {i + 1}: {err}") from err
        calibration = data.get("calibration") or {}
        check_calibration(calibration)  # before the defaults fill it in
        return Recipe(tuple(steps), {**DEFAULT_CALIBRATION, **calibration})
    except ValueError as err:
        raise ValueError(f"recipe {path}: {err}") from err


def apply_recipe(model: nn.Module, recipe: Recipe, calibration: torch.Tensor | None,
                 progress: bool = True) -> nn.Module:
    """Run every step of `recipe` on `model` in order (in place)."""
    for step in recipe.steps:
        verb = sparsify_ if isinstance(step, SemiStructured24) else quantize_
        verb(model, step, calibration=calibration, progress=progress)
    return model
