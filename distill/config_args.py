"""Command-line flags from a config dataclass: the dataclass is the one source of options and defaults.

Each field becomes a flag named after it (`max_vocab` -> `--max-vocab`) with the field's default,
its annotation as type (bool fields take `--x` / `--no-x`) and the help text, choices and value
check from `field(metadata=...)`:

    help:    what the option does (the flag's --help text; the default is appended)
    choices: the values allowed (argparse rejects others; `check_fields` too)
    check:   a function that raises ValueError("must be ...") for a bad value; argparse reports it
             against the flag while the command line is parsed, before anything is loaded

A float field must be finite (nan and inf are refused by flag and by config alike), and a field
that may be None (`float | None`) takes `none` on the command line.

A config calls `check_fields(self)` first in `__post_init__`, so a value is checked the same way
whether it comes from code or from the command line; checks that relate several fields stay in
`__post_init__` and reach the command line when `dataclass_from_args` builds the config.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from runtime.argtypes import at_least as at_least  # the `check`s configs use, shared with the plain flags'
from runtime.argtypes import number_arg
from runtime.argtypes import positive as positive

SCALARS = (bool, int, float, str)


def _optional(hint: Any) -> bool:
    """Whether type hint `hint` is a union (`X | None`)."""
    return isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union


def field_type(cls: type, field: dataclasses.Field) -> type:
    """The scalar type of `field` (bool, int, float or str); `X | None` gives X."""
    hint = typing.get_type_hints(cls)[field.name]
    if _optional(hint):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if hint not in SCALARS:
        raise TypeError(f"{cls.__name__}.{field.name}: a command-line flag needs a bool, int, float or str "
                        f"field, not {hint}")
    return hint


def _check_value(field: dataclasses.Field, value: Any) -> None:
    """Raise ValueError("must ...") when `value` is a float that is not finite or breaks the field's
    choices or check (None passes)."""
    if value is None:
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"must be a finite number, got {value}")
    choices = field.metadata.get("choices")
    if choices is not None and value not in choices:
        raise ValueError(f"must be one of {', '.join(map(repr, choices))}, got {value!r}")
    check = field.metadata.get("check")
    if check is not None:
        check(value)


def check_fields(config: Any) -> None:
    """Check every field of dataclass instance `config` against its metadata's choices and check;
    the ValueError names the field (`MedusaTrainConfig.lr must be ...`)."""
    for f in dataclasses.fields(config):
        try:
            _check_value(f, getattr(config, f.name))
        except ValueError as err:
            raise ValueError(f"{type(config).__name__}.{f.name} {err}") from None


def _parser_for(field: dataclasses.Field, kind: type, optional: bool) -> Callable[[str], Any]:
    """argparse `type` of a non-bool field: convert (ints and finite floats through
    runtime.argtypes.number_arg; `none` for a field that may be None), then check (errors name the flag)."""
    def check(value: Any) -> None:
        _check_value(field, value)

    convert = number_arg(kind, check) if kind in (int, float) else None

    def parse(text: str) -> Any:
        if optional and text.lower() == "none":
            return None
        if convert is not None:
            return convert(text)
        try:
            check(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
        return text

    parse.__name__ = kind.__name__
    return parse


def field_arg(cls: type, name: str) -> Callable[[str], Any]:
    """The argparse `type` of field `name` of dataclass `cls`, for a command that takes that field
    under a flag and help of its own: the value is converted and checked as the field's own flag does."""
    field = next((f for f in dataclasses.fields(cls) if f.name == name), None)
    if field is None:
        raise ValueError(f"{cls.__name__} has no field {name}")
    return _parser_for(field, field_type(cls, field), _optional(typing.get_type_hints(cls)[field.name]))


def flag_name(name: str) -> str:
    """The flag of field `name`: `--` and the name with dashes."""
    return "--" + name.replace("_", "-")


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type,
                       skip: Iterable[str] = (), flags: Mapping[str, str] | None = None,
                       defaults: Mapping[str, Any] | None = None) -> None:
    """Add a flag for every field of dataclass `cls` except those in `skip` to `parser` (or a group).

    The value lands in `args.<field name>` (`dataclass_from_args` reads it back). flags: another
    flag for some fields, e.g. {"batch_size": "--train-batch"} where `--batch-size` means
    something else. defaults: values a caller (a recipe) uses instead of the field defaults; they
    are checked like command-line values.
    """
    skip, flags, defaults = set(skip), dict(flags or {}), dict(defaults or {})
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = (skip | set(flags) | set(defaults)) - names
    if unknown:
        raise ValueError(f"{cls.__name__} has no field(s) {', '.join(sorted(unknown))}")
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        kind = field_type(cls, f)
        default = defaults.get(f.name, f.default)
        if default is dataclasses.MISSING:
            raise ValueError(f"{cls.__name__}.{f.name} has no default: give one in `defaults` or skip it")
        if f.name in defaults:
            try:
                _check_value(f, default)
            except ValueError as err:
                raise ValueError(f"default of {cls.__name__}.{f.name} {err}") from None
        text = f.metadata.get("help", f"{cls.__name__}.{f.name}")
        common = {"dest": f.name, "default": default, "help": f"{text} (default: %(default)s)"}
        flag = flags.get(f.name, flag_name(f.name))
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, **common)
        else:
            optional = _optional(typing.get_type_hints(cls)[f.name])
            parser.add_argument(flag, type=_parser_for(f, kind, optional), choices=f.metadata.get("choices"), **common)


def dataclass_from_args(cls: type, args: argparse.Namespace, **changes: Any) -> Any:
    """An instance of `cls` from the fields `add_dataclass_args` parsed into `args` (fields without a
    value there keep their defaults); `changes` override both."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    return cls(**{**values, **changes})
