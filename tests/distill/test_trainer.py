"""distill.trainer on a tiny regression task: the schedule, the shared config fields, resume that
equals an uninterrupted run, the deadline, evaluation cadence, atomic checkpoints, plot and metrics."""

import dataclasses
import json
import os
import stat
import time
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from distill.draft.train import DistillConfig
from distill.eagle.train import EagleTrainConfig
from distill.medusa.train import MedusaTrainConfig
from distill.recover.train import RecoverConfig
from distill.trainer import (
    CheckpointDir,
    StepCheckpoints,
    Task,
    Trainer,
    TrainerConfig,
    _lr_at,
    _time_progress,
    set_lr,
    trainer_field,
)


@dataclass(frozen=True)
class ToyConfig(TrainerConfig):
    lr: float = trainer_field("lr", 0.05)
    warmup_steps: int = trainer_field("warmup_steps", 2)
    checkpoint_every: int = trainer_field("checkpoint_every", 3)
    mixed_precision: str = trainer_field("mixed_precision", "no")


class Toy(Task):
    """Fit y = x w on 64 fixed points; each step two micro-batches of 8 points drawn by step."""

    desc = "toy"

    def __init__(self, steps: int = 8, eval_every: int | None = None, fail_in_step: int | None = None) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(64, 4, generator=g)
        self.y = self.x @ torch.randn(4, 1, generator=g)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1)
            self.layer = nn.Linear(4, 1)
        self.total_steps, self.eval_every, self.fail_in_step = steps, eval_every, fail_in_step
        self.seen = []  # the steps whose loss was asked for

    def module(self) -> nn.Module:
        return self.layer

    def micro_batches(self, run, step):
        idx = torch.randperm(64, generator=torch.Generator().manual_seed(step))[:16]
        return [idx[:8], idx[8:]]

    def loss(self, run, idx):
        if run.step == self.fail_in_step:
            raise KeyboardInterrupt
        self.seen.append(run.step)
        with run.autocast():
            pred = run.model(self.x[idx])
        return F.mse_loss(pred.float(), self.y[idx]) / 2  # two micro-batches: their sum is the step's mean

    def evaluate(self, run):
        with torch.no_grad():
            return {"mse": float(F.mse_loss(self.layer(self.x), self.y))}

    def save_weights(self, directory):
        save_file({k: v.detach().clone() for k, v in self.layer.state_dict().items()},
                  str(directory / "toy.safetensors"))

    def load_weights(self, directory):
        self.layer.load_state_dict(load_file(str(directory / "toy.safetensors")))


def _weights(task: Toy) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in task.layer.state_dict().items()}


def test_warmup_is_linear_then_the_rate_decays_as_a_cosine():
    cfg = ToyConfig(lr=1.0, warmup_steps=4)
    assert [_lr_at(s, 0.0, cfg) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert _lr_at(10, 0.0, cfg) == 1.0 and _lr_at(10, 0.5, cfg) == pytest.approx(0.5)
    assert _lr_at(10, 1.0, cfg) == pytest.approx(0.0) and _lr_at(10, 3.0, cfg) == pytest.approx(0.0)
    opt = torch.optim.AdamW([nn.Parameter(torch.zeros(1))])
    set_lr(opt, 6, 8, 0.0, None, cfg)  # 6 of 8 steps: 3/4 of the decay
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5 * (1 + torch.cos(torch.tensor(0.75 * torch.pi)).item()))
    set_lr(opt, 6, 1000, 90.0, time.monotonic() + 10.0, cfg)  # 90 of 100 seconds: the time decides
    assert opt.param_groups[0]["lr"] == pytest.approx(_lr_at(6, 0.9, cfg), abs=1e-3)


def test_the_deadline_schedule_goes_on_where_a_resumed_run_stopped():
    assert _time_progress(30.0, 30.0) == 0.5  # also: stopped after 30 s, resumed with 30 s left: no jump
    assert _time_progress(60.0, 0.0) == 1.0  # the deadline reached: fully decayed
    assert _time_progress(60.0, 60.0) == 0.5  # a finished run given as long again: mid-decay, not zero
    assert _time_progress(10.0, -5.0) == 1.0


@pytest.mark.parametrize("config", [MedusaTrainConfig, EagleTrainConfig, DistillConfig, RecoverConfig])
def test_the_shared_fields_are_declared_once(config):
    base = {f.name: f for f in dataclasses.fields(TrainerConfig)}
    for f in dataclasses.fields(config):
        if f.name in base:
            assert f.metadata == base[f.name].metadata, f.name  # one help text and check per shared field
    assert config().lr != TrainerConfig().lr  # each method keeps its own default
    with pytest.raises(ValueError, match=rf"{config.__name__}.lr must be > 0"):
        config(lr=0.0)
    with pytest.raises(ValueError, match="mixed_precision must be one of 'auto'"):
        config(mixed_precision="fp8")
    with pytest.raises(ValueError, match="max_grad_norm must be > 0"):
        config(max_grad_norm=0.0)


def test_training_learns_evaluates_and_reports(tmp_path):
    task = Toy(steps=12, eval_every=5)
    run = Trainer(task, ToyConfig(), tmp_path, CheckpointDir(tmp_path / "checkpoint")).fit()
    assert run.step == 12 and len(run.losses) == 12 and run.losses[-1] < 0.5 * run.losses[0]
    assert [e["step"] for e in run.evals] == [0, 5, 10, 12]  # before training, every 5 steps and at the end
    metrics = run.report({"extra": 1})
    assert metrics["steps"] == metrics["planned_steps"] == 12 and metrics["extra"] == 1
    assert metrics["final_loss"] == pytest.approx(sum(run.losses) / 12) and metrics["config"]["lr"] == 0.05
    assert json.loads((tmp_path / "metrics.json").read_text()) == metrics
    assert (tmp_path / "loss.png").stat().st_size > 1000
    meta = json.loads((tmp_path / "checkpoint" / "trainer.json").read_text())
    assert meta["step"] == 12 and meta["losses"] == run.losses and meta["evals"] == run.evals
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint", "loss.png", "metrics.json"]


@pytest.mark.parametrize("layout", [CheckpointDir, StepCheckpoints])
def test_a_stopped_run_resumes_to_the_state_of_an_uninterrupted_one(tmp_path, layout):
    whole = Toy(eval_every=3)
    Trainer(whole, ToyConfig(), tmp_path, layout(tmp_path / "a")).fit()
    parts = Toy(eval_every=3, fail_in_step=5)  # Ctrl-C during step 6, after the checkpoint of step 3
    with pytest.raises(KeyboardInterrupt):
        Trainer(parts, ToyConfig(), tmp_path, layout(tmp_path / "b")).fit()
    stopped = json.loads((layout(tmp_path / "b").latest() / "trainer.json").read_text())
    assert stopped["step"] == 5 and len(stopped["losses"]) == 5  # the finally kept the steps done
    resumed = Toy(eval_every=3)
    run = Trainer(resumed, ToyConfig(), tmp_path, layout(tmp_path / "b")).fit()
    assert resumed.seen[0] == 5  # it went on from step 5, not from the start
    a = json.loads((layout(tmp_path / "a").latest() / "trainer.json").read_text())
    assert run.losses == a["losses"] and [e["step"] for e in run.evals] == [0, 3, 6, 8]
    for k, v in _weights(whole).items():
        assert torch.equal(v, _weights(resumed)[k]), k  # bit for bit: weights, optimizer and schedule restored


def test_stop_after_and_a_passed_deadline_end_early_and_a_later_call_goes_on(tmp_path):
    ckpt = StepCheckpoints(tmp_path / "ckpt")
    run = Trainer(Toy(), ToyConfig(), tmp_path, ckpt).fit(stop_after=4)
    assert run.step == 4 and json.loads((tmp_path / "ckpt" / "latest.json").read_text())["step"] == 4
    late = Toy()
    run = Trainer(late, ToyConfig(), tmp_path, ckpt).fit(deadline=time.monotonic() - 1)
    assert run.step == 4 and late.seen == []  # past the deadline: no step starts
    spent = json.loads((tmp_path / "ckpt" / "step-0000004" / "trainer.json").read_text())["train_seconds"]
    run = Trainer(Toy(), ToyConfig(), tmp_path, ckpt).fit(deadline=time.monotonic() + 600)
    assert run.step == 8 and run.seconds() > spent > 0  # the seconds of earlier calls count on
    steps = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.is_dir())
    assert steps == ["step-0000006", "step-0000008"]  # the newest and keep=1 before it
    with pytest.raises(ValueError, match="^the time budget .* ran out before the first training step: nothing was "
                                         "trained or saved"):
        Trainer(Toy(), ToyConfig(), None, CheckpointDir(tmp_path / "none")).fit(deadline=time.monotonic() - 1)
    assert not (tmp_path / "none").exists()  # nothing trained: no checkpoint, and an error saying why


@pytest.mark.parametrize("layout", [CheckpointDir, StepCheckpoints])
def test_a_checkpoint_stopped_while_written_leaves_the_previous_one_whole(tmp_path, layout, monkeypatch):
    ckpt = layout(tmp_path / "ckpt")
    Trainer(Toy(), ToyConfig(), tmp_path, ckpt).fit(stop_after=3)
    before = {p.name: p.read_bytes() for p in ckpt.latest().iterdir()}
    task = Toy()

    def half_written(directory):  # the weights written, then the job killed before the optimizer and state
        Toy.save_weights(task, directory)
        raise KeyboardInterrupt

    monkeypatch.setattr(task, "save_weights", half_written)
    with pytest.raises(KeyboardInterrupt):
        Trainer(task, ToyConfig(), tmp_path, ckpt).fit()  # its first checkpoint, at step 6, never completes
    assert {p.name: p.read_bytes() for p in ckpt.latest().iterdir()} == before
    assert not [p for p in (tmp_path / "ckpt").parent.rglob("*.tmp")]  # no temporary directory left
    resumed = Toy()
    Trainer(resumed, ToyConfig(), tmp_path, ckpt).fit()
    assert resumed.seen[0] == 3


@pytest.mark.parametrize("layout", [CheckpointDir, StepCheckpoints])
def test_checkpoints_are_readable_by_others_as_the_umask_allows(tmp_path, layout):
    ckpt = layout(tmp_path / "ckpt")
    old = os.umask(0o022)
    try:
        Trainer(Toy(), ToyConfig(), tmp_path, ckpt).fit(stop_after=3)
    finally:
        os.umask(old)
    latest = ckpt.latest()
    assert stat.S_IMODE(latest.stat().st_mode) == 0o755  # not mkdtemp's 0700
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in latest.iterdir()} == {
        "toy.safetensors": 0o644, "optimizer.pt": 0o644, "trainer.json": 0o644}


def test_a_checkpoint_dir_stopped_between_its_renames_is_found(tmp_path):
    ckpt = CheckpointDir(tmp_path / "checkpoint")
    Trainer(Toy(), ToyConfig(), tmp_path, ckpt).fit(stop_after=3)
    (tmp_path / "checkpoint").rename(ckpt.old)  # the old one moved aside, the new one not yet in place
    assert ckpt.latest() == ckpt.old
    resumed = Toy()
    Trainer(resumed, ToyConfig(), tmp_path, ckpt).fit()
    assert resumed.seen[0] == 3 and ckpt.latest() == tmp_path / "checkpoint" and not ckpt.old.exists()


def test_fp16_autocasts_the_forward_and_scales_the_loss(tmp_path):
    task = Toy(steps=6)
    run = Trainer(task, ToyConfig(mixed_precision="fp16", max_grad_norm=1.0), None, None).fit()
    assert run.scaler.is_enabled() and run.precision == "fp16"
    assert all(torch.isfinite(torch.tensor(run.losses))) and run.losses[-1] < run.losses[0]
    with run.autocast():
        assert task.layer(task.x).dtype == torch.float16
