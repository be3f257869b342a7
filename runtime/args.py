"""Checks of the Python API's arguments, made where a public function starts (`runtime.load_model`,
`runtime.fetch`, `specdec.generate`, ...), before anything is loaded or run.

An argument of the wrong type raises TypeError, one of the right type but a value outside what the
function takes raises ValueError; each message is one line that names the argument, shows what it
got and says what is accepted. (The sampling settings are `specdec.SamplingParams`' own checks.)
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch


def describe(value: Any) -> str:
    """`value` as a one-line error message shows it: its repr (cut at 60 characters) and its type; a
    torch module (whose repr spans many lines) by its class."""
    if isinstance(value, torch.nn.Module):
        return f"a {type(value).__name__} module"
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({type(value).__name__})"


def check_int(name: str, value: Any, minimum: int = 0, optional: bool = False) -> int | None:
    """`value` as an int >= `minimum` (None passes when `optional`); a bool, a float or "8" is no int."""
    if value is None and optional:
        return None
    accepted = f"an integer >= {minimum}" + (" or None" if optional else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be {accepted}, got {describe(value)}")
    if value < minimum:
        raise ValueError(f"{name} must be {accepted}, got {value}")
    return int(value)


def check_bool(name: str, value: Any) -> bool:
    """`value` when it is True or False (a string such as "no" would read as True)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {describe(value)}")
    return value


# the longest path and path component (bytes) Linux and macOS take: a longer name is no file
PATH_MAX, NAME_MAX = 4096, 255


def check_path_length(name: str, text: str) -> None:
    """ValueError naming `name` when `text` cannot be a file name: longer than PATH_MAX bytes, or with
    a component ('/'-separated part) longer than NAME_MAX bytes. The OS would answer every look-up
    of it with OSError [Errno 36] (File name too long) instead of "no such file"."""
    encoded = text.encode("utf-8", "surrogatepass")
    longest = max((len(part) for part in encoded.split(b"/")), default=0)
    if len(encoded) > PATH_MAX or longest > NAME_MAX:
        raise ValueError(f"{name} is {len(text)} characters long ({describe(text)}), longer than a file or model "
                         f"name can be ({NAME_MAX} bytes per path component, {PATH_MAX} in all)")


def check_path(name: str, value: Any, accepted: str) -> str | os.PathLike:
    """`value` when it is a non-empty str or os.PathLike no longer than a path can be; `accepted` says
    what it may name."""
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name} must be {accepted} (a str or a Path), got {describe(value)}")
    if not str(value).strip():
        raise ValueError(f"{name} is empty; pass {accepted}")
    check_path_length(name, str(value))
    return value


def check_dtype(name: str, value: Any, accepted: Mapping[str, torch.dtype]) -> torch.dtype:
    """`value` as one of the `accepted` torch dtypes, given as the dtype or its name ("bfloat16")."""
    listing = ", ".join(str(d) for d in accepted.values()) + f" (or their names: {', '.join(accepted)})"
    if isinstance(value, str):
        if value not in accepted:
            raise ValueError(f"{name} must be one of {listing}, got {value!r}")
        return accepted[value]
    if not isinstance(value, torch.dtype):
        raise TypeError(f"{name} must be one of {listing}, got {describe(value)}")
    if value not in accepted.values():
        raise ValueError(f"{name} must be one of {listing}, got {value}")
    return value


def check_methods(name: str, value: Any, methods: Iterable[str], what: str) -> None:
    """TypeError unless `value` has every one of `methods` as a callable; `what` names what fits."""
    methods = list(methods)
    missing = [m for m in methods if not callable(getattr(value, m, None))]
    if missing:
        raise TypeError(f"{name} must be {what} with {' and '.join(f'{m}()' for m in methods)}, got {describe(value)}, "
                        f"which has no {' or '.join(f'{m}()' for m in missing)}")


def check_instance(name: str, value: Any, cls: type, what: str) -> None:
    """TypeError unless `value` is an instance of `cls`; `what` names what fits."""
    if not isinstance(value, cls):
        raise TypeError(f"{name} must be {what}, got {describe(value)}")


def check_data(name: str, tensor: torch.Tensor) -> None:
    """ValueError for a tensor on the meta device: it has a shape but no values to read."""
    if tensor.device.type == "meta":
        raise ValueError(f"{name} is on the meta device, which holds no values; pass it on the CPU or the "
                         "model's device")


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether `a` and `b` are one device ("cuda" is "cuda:0")."""
    return a.type == b.type and (a.index or 0) == (b.index or 0)


def check_generator(name: str, generator: Any, device: torch.device) -> None:
    """TypeError unless `generator` is None or a torch.Generator; ValueError when it lives on
    another device than `device`, where the random draws happen."""
    if generator is None:
        return
    check_instance(name, generator, torch.Generator, "a torch.Generator or None")
    if not same_device(generator.device, device):
        raise ValueError(f"{name} is on {generator.device} but the model runs on {device}; create it with "
                         f"torch.Generator(device={str(device)!r})")


def check_model(name: str, model: Any) -> None:
    """TypeError unless `model` is a runtime model (it has a config and makes its own KV cache); a path
    or name is refused with the call that loads it."""
    if isinstance(model, (str, os.PathLike)):
        raise TypeError(f"{name} must be a loaded model, got the path or name {str(model)!r}; load it first: "
                        f"runtime.load_model({str(model)!r})")
    if not (callable(getattr(model, "new_cache", None)) and hasattr(model, "config")):
        raise TypeError(f"{name} must be a runtime model (runtime.load_model) or a transformers PreTrainedModel, "
                        f"got {describe(model)}")


def check_module(name: str, value: Any, what: str) -> None:
    """TypeError unless `value` is a torch.nn.Module; a path or name is refused with the call that
    loads it; `what` names what fits."""
    if isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name} must be {what}, got the path or name {str(value)!r}; load it first: "
                        f"runtime.load_model({str(value)!r})")
    if not isinstance(value, torch.nn.Module):
        raise TypeError(f"{name} must be {what}, got {describe(value)}")
