"""Compression configs: frozen dataclasses validated on construction, plus recipe (de)serialisation.

Every field is type-checked first (`_check_type`: a bool field takes only True / False, an int
field no "64" or 64.0, a float field any real number), the same check for the Python API and for a
recipe's YAML; then the values are range-checked.

Every config selects the `nn.Linear` modules it compresses by fully-qualified name
(`fnmatch` patterns over names such as `layers.3.mlp.w13`): `modules` to include, `exclude`
to drop. Embeddings are never touched; `lm_head` only with `include_lm_head=True` (it is a
large share of a small model's bytes; a tied head is untied, the embedding stays dense).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from runtime.args import describe

GROUP_SIZES = (32, 64, 128, 256)
NF4_BLOCKSIZES = (64, 128, 256, 512, 1024, 2048, 4096)
INT4_GRIDS = ("mse", "minmax")
GPTQ_GRIDS = (*INT4_GRIDS, "hmse")  # "hmse": weighted by the calibration Hessian's diagonal
ZERO_POINTS = ("float", "integer")  # INT4 zero kinds (quant.grids.int4_grid)


@dataclass(frozen=True)
class ModuleFilter:
    """Which linears a config applies to (names relative to the model, fnmatch patterns)."""

    modules: tuple[str, ...] = ("*",)
    exclude: tuple[str, ...] = ()
    include_lm_head: bool = False

    def __post_init__(self) -> None:
        kind = type(self).__name__
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, _check_type(kind, f.name, hints[f.name], getattr(self, f.name)))
        if not self.modules:
            raise ValueError(f"{type(self).__name__}.modules is empty: nothing would be compressed")


@dataclass(frozen=True)
class Int8WeightOnly(ModuleFilter):
    """Per-output-channel symmetric INT8 weights (round to nearest), activations unchanged."""


@dataclass(frozen=True)
class Int4WeightOnly(ModuleFilter):
    """Group-wise asymmetric INT4 weights. method "rtn" (round to nearest) or "gptq" (needs calibration).

    grid "mse" shrinks each group's [min, max] range where that lowers its squared rounding
    error; "minmax" always spans it (quant.grids.int4_grid). None picks per method, by held-out
    perplexity (docs/experiments/2026-11-21-int4-grid.md): "mse" for RTN and for GPTQ with
    act_order, whose grids are fixed from the weights before any update; "minmax" for GPTQ in
    input order, whose grids are picked mid-solve from weights the error feedback has moved. GPTQ
    also takes "hmse": "mse" with each weight's rounding error weighted by its input's mean square
    (diag of the calibration Hessian); not a default (perplexity within noise of "mse").

    zero_point "integer" picks, per group, an integer zero point z in [0, 15] (w = (q - z) * s, the
    form GPTQ, AutoGPTQ and compressed-tensors store), so a compressed-tensors export holds the
    weights exactly; "float" lets the zero be any bf16 value (a compressed-tensors export must then
    move each group onto an integer zero point, quant.compressed_tensors.align_zero_points).
    """

    group_size: int = 128
    method: str = "rtn"
    act_order: bool = False
    grid: str | None = None
    damp: float = 0.01
    block_size: int = 128
    zero_point: str = "float"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"Int4WeightOnly.group_size must be one of {GROUP_SIZES}, got {self.group_size}")
        if self.method not in ("rtn", "gptq"):
            raise ValueError(f"Int4WeightOnly.method must be 'rtn' or 'gptq', got {self.method!r}")
        if self.grid is None:
            object.__setattr__(self, "grid", "minmax" if self.method == "gptq" and not self.act_order else "mse")
        grids = GPTQ_GRIDS if self.method == "gptq" else INT4_GRIDS
        if self.grid not in grids:
            raise ValueError(f"Int4WeightOnly.grid must be one of {grids} for method={self.method!r}, "
                             f"got {self.grid!r}")
        if self.act_order and self.method != "gptq":
            raise ValueError("Int4WeightOnly.act_order only applies to method='gptq'")
        if self.zero_point not in ZERO_POINTS:
            raise ValueError(f"Int4WeightOnly.zero_point must be one of {ZERO_POINTS} ('integer' exports to "
                             f"compressed-tensors exactly), got {self.zero_point!r}")
        _check_damp(self)
        if self.block_size < 1 or self.block_size % 4:
            raise ValueError(f"Int4WeightOnly.block_size must be a positive multiple of 4, got {self.block_size}")


@dataclass(frozen=True)
class NF4(ModuleFilter):
    """bitsandbytes 4-bit NormalFloat, blocks of `blocksize`, optional double quantization of the scales."""

    blocksize: int = 64
    double_quant: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.blocksize not in NF4_BLOCKSIZES:
            raise ValueError(f"NF4.blocksize must be one of {NF4_BLOCKSIZES}, got {self.blocksize}")


@dataclass(frozen=True)
class Int8Mixed(ModuleFilter):
    """LLM.int8 through bitsandbytes: INT8 weights, input columns with |x| >= threshold kept in 16-bit."""

    threshold: float = 6.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.threshold > 0:
            raise ValueError(f"Int8Mixed.threshold must be > 0, got {self.threshold}")


@dataclass(frozen=True)
class SemiStructured24(ModuleFilter):
    """2:4 sparsity (2 of every 4 inputs zero per output row).

    method: "magnitude" (|W|), "wanda" (|W| * ||X||, needs calibration), "sparsegpt" (needs
    calibration; error feedback). int4_group_size: also quantize the kept weights to INT4 in
    the same pass (prune, then quantize the survivors with error feedback; sparsegpt only),
    on min-max grids (a group's grid is chosen before most of its prune masks are known).
    """

    method: str = "sparsegpt"
    damp: float = 0.01
    block_size: int = 128
    int4_group_size: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.method not in ("magnitude", "wanda", "sparsegpt"):
            raise ValueError(f"SemiStructured24.method must be 'magnitude', 'wanda' or 'sparsegpt', "
                             f"got {self.method!r}")
        _check_damp(self)
        if self.block_size < 4 or self.block_size % 4:
            raise ValueError(f"SemiStructured24.block_size must be a positive multiple of 4, got {self.block_size}")
        if self.int4_group_size is not None:
            if self.method != "sparsegpt":
                raise ValueError("SemiStructured24.int4_group_size needs method='sparsegpt' (quantizing the "
                                 "survivors uses its error feedback)")
            if self.int4_group_size not in GROUP_SIZES:
                raise ValueError(f"SemiStructured24.int4_group_size must be one of {GROUP_SIZES}, "
                                 f"got {self.int4_group_size}")

    @property
    def needs_calibration(self) -> bool:
        return self.method != "magnitude"


def _check_damp(cfg: Any) -> None:
    if not 0 < cfg.damp < 1:
        raise ValueError(f"{type(cfg).__name__}.damp must be in (0, 1), got {cfg.damp}")


CONFIGS = {cls.__name__: cls for cls in (Int8WeightOnly, Int4WeightOnly, NF4, Int8Mixed, SemiStructured24)}
Config = Int8WeightOnly | Int4WeightOnly | NF4 | Int8Mixed | SemiStructured24


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """{"type": class name, **fields}: the JSON / YAML form of a config."""
    out = {"type": type(cfg).__name__}
    for key, value in dataclasses.asdict(cfg).items():
        out[key] = list(value) if isinstance(value, tuple) else value
    return out


def unknown_keys(where: str, keys: Iterable[Any], allowed: Iterable[str]) -> None:
    """ValueError naming each key of `keys` not in `allowed` (with the closest allowed key, when one
    is close) and listing the allowed keys; `where` says which mapping ("calibration", "Int4WeightOnly")."""
    allowed = sorted(allowed)
    unknown = [k for k in keys if k not in allowed]
    if not unknown:
        return
    named = []
    for key in unknown:
        close = difflib.get_close_matches(str(key), allowed, n=1)
        named.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise ValueError(f"{where}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(named)}; allowed: "
                     f"{', '.join(allowed)}")


# value types a config field takes: the test and how a message names it (YAML's and Python's spelling)
_VALUE_TYPES = {bool: (lambda v: isinstance(v, bool), "a boolean (true or false)"),
                int: (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
                float: (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number"),
                str: (lambda v: isinstance(v, str), "a string")}


def _check_type(kind: str, name: str, hint: Any, value: Any) -> Any:
    """`value` as field `name` of config `kind` holds it (a list of patterns as a tuple, an integer
    as a float for a float field); TypeError naming the field when the type is wrong (a string for a
    number, "yes" for a bool, ...)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):  # `X | None`
        if value is None:
            return value
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if typing.get_origin(hint) is tuple:  # fnmatch patterns
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            return tuple(value)
        raise TypeError(f"{kind}.{name} must be a list of fnmatch patterns (strings), got {describe(value)}")
    test, wanted = _VALUE_TYPES[hint]
    if not test(value):
        raise TypeError(f"{kind}.{name} must be {wanted}, got {describe(value)}")
    return float(value) if hint is float else value


def config_from_dict(data: dict[str, Any]) -> Config:
    """Inverse of `config_to_dict`; an unknown type or key raises ValueError naming it (and the closest
    valid one), a value of the wrong type TypeError naming the field."""
    if not isinstance(data, dict) or "type" not in data:
        raise ValueError(f"a recipe entry must be a mapping with a 'type' key (one of {', '.join(CONFIGS)}), "
                         f"got {data!r}")
    kind = data["type"]
    if kind not in CONFIGS:
        close = difflib.get_close_matches(str(kind), list(CONFIGS), n=1)
        raise ValueError(f"unknown config type {kind!r}{f' (did you mean {close[0]!r}?)' if close else ''}; use "
                         f"one of {', '.join(CONFIGS)}")
    cls = CONFIGS[kind]
    fields = {k: v for k, v in data.items() if k != "type"}
    unknown_keys(kind, fields, ["type", *(f.name for f in dataclasses.fields(cls))])
    return cls(**fields)  # __post_init__ checks each value's type
