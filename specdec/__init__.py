"""specdec: speculative decoding on the runtime engine. `generate`, `stream`, the continuous-batching
`Engine`, drafters (named by a `DrafterSpec` string), `SamplingParams`, verification, stats.

The names below import on first use (PEP 562), so `import specdec` (and the `specdec` command,
whose entry point lives in this package) starts without loading torch; the command then imports
what it runs inside its own error handling, where Ctrl-C is one line and exit status 130.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

# public name -> the module that defines it
_EXPORTS = {
    "DecodeObserver": "specdec.capture", "StateCapture": "specdec.capture",
    "Accepted": "specdec.drafter", "Drafter": "specdec.drafter", "DraftTree": "specdec.drafter",
    "Eagle3Config": "specdec.drafters.eagle.head", "Eagle3Head": "specdec.drafters.eagle.head",
    "load_eagle": "specdec.drafters.eagle.io", "save_eagle": "specdec.drafters.eagle.io",
    "DrafterSpec": "specdec.methods",
    "GenerateOutput": "specdec.generate", "generate": "specdec.generate", "stream": "specdec.generate",
    "SamplingParams": "specdec.sampling",
    "Engine": "specdec.serving.engine", "Request": "specdec.serving.engine",
    "AcceptanceStats": "specdec.stats",
}

__all__ = ["generate", "stream", "GenerateOutput", "Engine", "SamplingParams", "Request",
           "AcceptanceStats", "Drafter", "DrafterSpec", "DraftTree", "Accepted",
           "Eagle3Config", "Eagle3Head", "save_eagle", "load_eagle", "DecodeObserver", "StateCapture"]

if TYPE_CHECKING:
    from specdec.capture import DecodeObserver, StateCapture
    from specdec.drafter import Accepted, Drafter, DraftTree
    from specdec.drafters.eagle.head import Eagle3Config, Eagle3Head
    from specdec.drafters.eagle.io import load_eagle, save_eagle
    from specdec.generate import GenerateOutput, generate, stream
    from specdec.methods import DrafterSpec
    from specdec.sampling import SamplingParams
    from specdec.serving.engine import Engine, Request
    from specdec.stats import AcceptanceStats


def __getattr__(name: str) -> Any:
    """A public name of `_EXPORTS`, imported on first use and kept; a submodule (`specdec.serving`)
    imported on attribute access."""
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as err:
        if err.name != f"{__name__}.{name}":
            raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """This package's module type: importing the submodule `specdec.generate` binds the package's
    `generate` attribute to that module; the attribute stays the function (as `from specdec import
    generate` gives), whichever was imported first."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "generate" and isinstance(value, types.ModuleType) and value.__name__ == "specdec.generate":
            value = value.generate
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
