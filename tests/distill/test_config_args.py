"""distill.config_args: flags from dataclass fields; the Medusa recipes' training flags come from MedusaTrainConfig."""

import argparse
import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from distill.config_args import add_dataclass_args, at_least, check_fields, dataclass_from_args, flag_name
from distill.medusa.train import MedusaTrainConfig

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
                          (["--steps", "two"], "argument --steps: expected an integer, got 'two'"),
                          (["--mode", "medium"], "argument --mode: must be one of 'fast', 'slow', got 'medium'")):
        with pytest.raises(SystemExit):
            p.parse_args(argv)
        assert message in capsys.readouterr().err
    with pytest.raises(ValueError, match="Example.steps must be >= 1, got 0"):
        Example(steps=0)
    with pytest.raises(ValueError, match="Example.mode must be one of 'fast', 'slow', got 'medium'"):
        Example(mode="medium")


@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "NaN"])
def test_non_finite_floats_are_rejected_by_flag_and_by_the_config(text, capsys):
    with pytest.raises(SystemExit):
        parser().parse_args([f"--rate={text}"])
    assert "argument --rate: expected a finite number" in capsys.readouterr().err
    with pytest.raises(ValueError, match="Example.rate must be a finite number"):
        Example(rate=float(text))


def _float_fields():
    from distill.config_args import field_type
    from distill.draft.train import DistillConfig
    from distill.eagle.train import EagleTrainConfig
    from distill.recover.train import RecoverConfig

    return [(cls, f.name) for cls in (MedusaTrainConfig, EagleTrainConfig, DistillConfig, RecoverConfig)
            for f in dataclasses.fields(cls) if field_type(cls, f) is float]


@pytest.mark.parametrize("cls, name", _float_fields())
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_every_float_field_of_the_training_configs_refuses_non_finite_values(cls, name, value, capsys):
    with pytest.raises(ValueError, match=f"{cls.__name__}.{name} must be a finite number"):
        cls(**{name: value})
    p = argparse.ArgumentParser()
    add_dataclass_args(p, cls)
    with pytest.raises(SystemExit):
        p.parse_args([f"{flag_name(name)}={value}"])
    assert f"argument {flag_name(name)}: expected a finite number" in capsys.readouterr().err


def test_an_optional_field_takes_none_on_the_command_line():
    p = argparse.ArgumentParser()
    add_dataclass_args(p, MedusaTrainConfig)
    for text in ("none", "None"):
        assert p.parse_args(["--max-grad-norm", text]).max_grad_norm is None
    assert p.parse_args(["--max-grad-norm", "2"]).max_grad_norm == 2.0
    assert "(none: no clipping)" in " ".join(p.format_help().split())


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
