"""Shared by the tests of the scripts under benchmarks/: importing a script by its name."""

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_script(name: str):
    """benchmarks/NAME.py as a module (registered in sys.modules: its dataclasses look it up there), with
    benchmarks/ on sys.path as when it runs as a script (scripts import their siblings)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def load():
    return load_script
