"""distill.config_args: flags from dataclass fields; the Medusa recipes' training flags come from MedusaTrainConfig."""

import argparse
import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from distill.config_args import add_dataclass_args, at_least, check_fields, dataclass_from_args
from distill.train_medusa import MedusaTrainConfig

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


@dataclass(frozen=True)
class Example:
    steps: int = field(default=3, metadata={"help": "how many steps", "check": at_least(1)})
    rate: float = field(default=0.5, metadata={"help": "a rate"})
    mode: str = field(default="fast", metadata={"help": "how", "choices": ("fast", "slow")})
    verbose: bool = field(default=False, metadata={"help": "say more"})
    limit: int | None = None

    def __post_init__(self) -> None:
        check_fields(self)


def parser(**kw) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="example")
    add_dataclass_args(p, Example, **kw)
    return p


def test_flags_take_the_field_defaults_types_and_help():
    p = parser()
    assert dataclass_from_args(Example, p.parse_args([])) == Example()
    args = p.parse_args(["--steps", "7", "--rate", "0.25", "--mode", "slow", "--verbose", "--limit", "9"])
    assert dataclass_from_args(Example, args) == Example(steps=7, rate=0.25, mode="slow", verbose=True, limit=9)
    assert dataclass_from_args(Example, p.parse_args(["--verbose", "--no-verbose"])).verbose is False
    text = p.format_help()
    assert "how many steps (default: 3)" in text and "{fast,slow}" in text


def test_bad_values_are_rejected_by_flag_and_by_the_config(capsys):
    p = parser()
    for argv, message in ((["--steps", "0"], "argument --steps: must be >= 1, got 0"),
                          (["--steps", "two"], "argument --steps: expected int, got 'two'"),
                          (["--mode", "medium"], "argument --mode: must be one of 'fast', 'slow', got 'medium'")):
        with pytest.raises(SystemExit):
            p.parse_args(argv)
        assert message in capsys.readouterr().err
    with pytest.raises(ValueError, match="Example.steps must be >= 1, got 0"):
        Example(steps=0)
    with pytest.raises(ValueError, match="Example.mode must be one of 'fast', 'slow', got 'medium'"):
        Example(mode="medium")


def test_skip_rename_and_caller_defaults():
    p = parser(skip=["limit"], flags={"steps": "--train-steps"}, defaults={"rate": 0.75})
    args = p.parse_args(["--train-steps", "5"])
    assert not hasattr(args, "limit")
    assert dataclass_from_args(Example, args, mode="slow") == Example(steps=5, rate=0.75, mode="slow")
    with pytest.raises(ValueError, match="no field"):
        parser(defaults={"rates": 1.0})
    with pytest.raises(ValueError, match="default of Example.steps must be >= 1"):
        parser(defaults={"steps": 0})


@pytest.mark.parametrize("recipe", ["medusa_smollm2", "medusa_qwen_coder_1_5b"])
def test_recipe_training_flags_default_to_train_config_but_for_the_recipes_own_values(recipe, monkeypatch):
    import importlib

    monkeypatch.syspath_prepend(str(RECIPES))
    module = importlib.import_module(recipe)
    shared = sys.modules["medusa_smollm2"]
    args = shared.parser(module.DEFAULTS, module.TRAIN).parse_args([])
    assert dataclass_from_args(MedusaTrainConfig, args) == dataclasses.replace(MedusaTrainConfig(), **module.TRAIN)
    assert args.generation_batch == module.DEFAULTS["batch_size"]  # --batch-size: generation rows
    train = shared.parser(module.DEFAULTS, module.TRAIN).parse_args(["--train-batch", "128", "--batch-size", "8"])
    assert (train.batch_size, train.generation_batch) == (128, 8)
