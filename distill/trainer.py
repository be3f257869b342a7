"""The training loop every method of distill/ runs in: Medusa heads, EAGLE-3 heads, draft
distillation and 2:4 recovery.

    trainer = Trainer(task, config, out_dir, checkpoints)   # config: a TrainerConfig subclass
    trainer.fit(deadline=..., resume=True)                   # the loop; resumable
    trainer.report(metrics, panels)                          # OUT/<plot file> and OUT/<metrics file>

`Trainer` owns what the methods share: AdamW on the task's parameters, linear warm-up then cosine
decay (deadline-aware: `set_lr`), gradient clipping (`max_grad_norm`), autocast of the training
forward (`mixed_precision`; a gradient scaler for fp16), `accelerate` for the device and for
several processes (distill.accel), the progress bar, periodic evaluation, atomic checkpoints every
`checkpoint_every` steps and when stopped (Ctrl-C, SIGTERM, an error), resume from them, the loss
plot and the metrics file. A `Task` supplies what differs: the trained module and parameters, the
micro-batches of a step, their loss, an optional evaluation, how its weights are saved and
restored, and its own per-step records.

Checkpoints hold the task's weights as safetensors, `optimizer.pt` (tensors only, read with
`torch.load(weights_only=True)`) and a JSON file of the trainer's state (step, losses,
evaluations, training seconds, config, the task's own records). Each is written in a temporary
directory and renamed into place, so a stopped job never leaves half a checkpoint. Two layouts:
`CheckpointDir` (one directory, replaced whole) and `StepCheckpoints` (a directory per step and
`latest.json` naming the newest).
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import tempfile
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from distill.accel import autocast_mode, global_mean, synced_clock
from distill.config_args import at_least, check_fields, positive
from runtime.atomic import apply_umask, atomic_write, atomic_write_text
from runtime.progress import progress

OPTIMIZER = "optimizer.pt"
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class TrainerConfig:
    """The fields every training configuration of distill/ has (MedusaTrainConfig, EagleTrainConfig,
    DistillConfig, RecoverConfig extend it). A subclass that wants another default redeclares the
    field with `trainer_field(name, default)`, which keeps its help text and check."""

    lr: float = field(default=1e-3, metadata={"help": "peak AdamW learning rate (warm-up, then cosine decay)",
                                              "check": positive})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay", "check": at_least(0)})
    warmup_steps: int = field(default=20, metadata={"help": "steps of linear learning-rate warm-up",
                                                    "check": at_least(0)})
    max_grad_norm: float | None = field(default=None, metadata={
        "help": "gradient clipping: largest total gradient norm (none: no clipping)", "check": positive})
    checkpoint_every: int = field(default=100, metadata={"help": "steps between resumable checkpoints",
                                                         "check": at_least(1)})
    mixed_precision: str = field(default="auto", metadata={
        "help": "autocast mode of the training forward; auto: bf16 where the hardware multiplies it natively, "
                "else float32", "choices": ("auto", "no", "bf16", "fp16")})
    seed: int = field(default=0, metadata={
        "help": "seed of every random choice of training (data order, initialisation, samples, noise)"})

    def __post_init__(self) -> None:
        check_fields(self)

    def autocast_mode(self, device: torch.device) -> str:
        """The autocast mode of training on `device`: "no", "bf16" or "fp16" ("auto" resolved)."""
        return autocast_mode(self.mixed_precision, device)


def trainer_field(name: str, default: Any) -> Any:
    """TrainerConfig's field `name` with another default (its help text and check kept)."""
    return field(default=default, metadata=TrainerConfig.__dataclass_fields__[name].metadata)


def _lr_at(step: int, done: float, cfg: TrainerConfig) -> float:
    """Linear warm-up over `warmup_steps`, then cosine decay over `done`, the schedule's fraction in [0, 1]."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, done)))


def _time_progress(seconds: float, left: float) -> float:
    """How far a deadline-bound cosine decay has gone: the training seconds spent so far (earlier
    runs of a resumed job included) over those plus the seconds left to the deadline. A resumed
    run therefore goes on from where it stopped, and a later deadline (a raised budget) spreads
    the rest of the decay over the longer window instead of leaving the rate at zero."""
    return seconds / max(1e-9, seconds + max(0.0, left))


def set_lr(opt: torch.optim.Optimizer, step: int, total: int, seconds: float, deadline: float | None,
           cfg: TrainerConfig) -> None:
    """Give every parameter group of `opt` the schedule's rate at `step` of `total` (`_lr_at`); with a
    deadline (time.monotonic()), the decay also follows the training `seconds` spent against the time
    left (`_time_progress`), so a run cut by its deadline still ends annealed."""
    done = step / total
    if deadline is not None:
        done = max(done, _time_progress(seconds, deadline - time.monotonic()))
    for g in opt.param_groups:
        g["lr"] = _lr_at(step, done, cfg)


class CheckpointDir:
    """Checkpoints in one directory, replaced whole: a new one is written in a temporary directory
    beside it, the old one renamed to `.<name>.old`, the new one renamed into place, then the old one
    removed. Stopped at any point, `latest` finds a complete checkpoint (the new or the old one)."""

    def __init__(self, path: str | Path, meta: str = "trainer.json") -> None:
        self.path, self.meta = Path(path), meta
        self.old = self.path.parent / f".{self.path.name}.old"

    def latest(self) -> Path | None:
        """The directory of the newest complete checkpoint, or None without one."""
        return next((d for d in (self.path, self.old) if (d / self.meta).is_file()), None)

    def write(self, step: int, fill, state: dict) -> None:
        """Write a checkpoint: fill(directory) writes the weights and optimizer, then the state."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent))
        try:
            fill(tmp)
            apply_umask(tmp, recursive=True)  # mkdtemp's 0700 and save_file's 0600 would keep it from others
            (tmp / self.meta).write_text(json.dumps(state))
            if self.path.exists():  # else the old one, if any, is the only complete checkpoint: kept until now
                shutil.rmtree(self.old, ignore_errors=True)
                self.path.rename(self.old)
            tmp.rename(self.path)
            shutil.rmtree(self.old, ignore_errors=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


class StepCheckpoints:
    """Checkpoints as ROOT/step-N directories: each written in a temporary directory renamed into
    place, then `latest.json` (atomically) names it; of the older step directories the `keep` newest
    stay, the others are removed."""

    LATEST = "latest.json"

    def __init__(self, root: str | Path, meta: str = "trainer.json", keep: int = 1) -> None:
        self.root, self.meta, self.keep = Path(root), meta, keep

    def latest(self) -> Path | None:
        """The directory of the newest checkpoint, or None without one."""
        if not (self.root / self.LATEST).is_file():
            return None
        return self.root / json.loads((self.root / self.LATEST).read_text())["checkpoint"]

    def write(self, step: int, fill, state: dict) -> None:
        """Write checkpoint `step`: fill(directory) writes the weights and optimizer, then the state."""
        self.root.mkdir(parents=True, exist_ok=True)
        name = f"step-{step:07d}"
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=self.root))
        try:
            fill(tmp)
            apply_umask(tmp, recursive=True)  # mkdtemp's 0700 and save_file's 0600 would keep it from others
            (tmp / self.meta).write_text(json.dumps(state))
            final = self.root / name
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        atomic_write_text(self.root / self.LATEST, json.dumps({"checkpoint": name, "step": step}))
        old = sorted(p for p in self.root.glob("step-*") if p.is_dir() and p.name != name)
        for p in old[:-self.keep or None]:
            shutil.rmtree(p, ignore_errors=True)


class Task(ABC):
    """What a training method supplies to `Trainer`. Override what differs from these defaults.

    module(): the module whose forward is the training forward (accelerate prepares it: under DDP
    gradients are synchronised only for work inside that forward, see distill.accel.Forward).
    parameters(): the parameters AdamW trains. total_steps: the schedule's length.
    micro_batches(run, step): this process's micro-batches of global step `step` (anything `loss`
    takes; usually small descriptions, so that heavy data is made in `loss` one at a time).
    loss(run, micro): the loss of one micro-batch, weighted so that the sum over the step's
    micro-batches, averaged over processes, is the step's loss (distill.accel.local_part).
    """

    desc = "training"  # the progress bar's label
    plot_file = "loss.png"
    metrics_file = "metrics.json"
    loss_label = "loss"
    final_window = 50  # the metrics' final_loss is the mean of the last this many step losses
    eval_every: int | None = None  # evaluate() every this many steps (and at the start and the end)
    total_steps: int = 0

    @abstractmethod
    def module(self) -> nn.Module:
        """See the class docstring."""

    def parameters(self) -> list[nn.Parameter]:
        return [p for p in self.module().parameters() if p.requires_grad]

    def begin(self, run: Trainer) -> None:
        """Called once after the accelerator is ready and any checkpoint is restored (run.step)."""

    @abstractmethod
    def micro_batches(self, run: Trainer, step: int) -> Sequence:
        """See the class docstring."""

    @abstractmethod
    def loss(self, run: Trainer, micro) -> torch.Tensor:
        """See the class docstring."""

    def end_step(self, run: Trainer) -> None:
        """Called after each optimizer step (run.step already counts it): keep per-step records here."""

    def evaluate(self, run: Trainer) -> dict | None:
        """A held-out measurement of the current weights (a dict of numbers), or None for none."""
        return None

    @abstractmethod
    def save_weights(self, directory: Path) -> None:
        """Write the trained weights into a checkpoint directory (safetensors)."""

    @abstractmethod
    def load_weights(self, directory: Path) -> None:
        """Restore the weights `save_weights` wrote; ValueError when they belong to another setup."""

    def state(self) -> dict:
        """The task's own JSON state kept in a checkpoint (e.g. per-step records)."""
        return {}

    def load_state(self, state: dict) -> None:
        """Restore what `state()` returned."""


def out_of_time(before: str) -> str:
    """The message of a run whose time budget ended `before` it had a result (nothing was trained)."""
    return (f"the time budget (--max-minutes, the deadline) ran out before {before}: nothing was trained or "
            "saved; allow more time and run the same command again (it resumes what was cached)")


class Trainer:
    """Runs `task` under `config` (a TrainerConfig): see the module docstring.

    out_dir: where `report` writes the plot and the metrics (None: nowhere). checkpoints: a
    CheckpointDir or StepCheckpoints (None: no checkpoints, no resume). After `fit`: step, losses,
    evals ({"step", ...} records of `task.evaluate`), seconds(), acc (the Accelerator), model (the
    prepared module) and raw (the same, unwrapped from DDP).
    """

    def __init__(self, task: Task, config: TrainerConfig, out_dir: str | Path | None = None,
                 checkpoints: CheckpointDir | StepCheckpoints | None = None) -> None:
        from accelerate import Accelerator  # heavy (accelerate): loaded when training starts, not at CLI start

        self.task, self.config, self.checkpoints = task, config, checkpoints
        self.out_dir = Path(out_dir) if out_dir is not None else None
        params = task.parameters()
        device = params[0].device if params else torch.device("cpu")
        # mixed precision is applied by `autocast` rather than through accelerate's process-wide state,
        # which refuses a second setting in one process (several trainings in a test suite or a recipe)
        self.acc = Accelerator(cpu=device.type == "cpu", mixed_precision="no")
        self.precision = config.autocast_mode(device)
        self.scaler = torch.amp.GradScaler(self.acc.device.type, enabled=self.precision == "fp16")
        self.params = params
        self.opt = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
        self.step, self.losses, self.evals, self.before = 0, [], [], 0.0  # before: seconds of earlier runs
        self.model = self.raw = task.module()
        self._t_start = time.monotonic()
        self._saved = None  # the step of the checkpoint on disk
        self._evaluated = None  # the step last evaluated

    @property
    def total(self) -> int:
        return self.task.total_steps

    def autocast(self):
        """The autocast context of the training forward (`config.mixed_precision` resolved)."""
        if self.precision == "no":
            return nullcontext()
        return torch.autocast(self.acc.device.type, dtype=AUTOCAST_DTYPES[self.precision])

    def seconds(self) -> float:
        """Training seconds so far, earlier runs of a resumed job included."""
        return self.before + time.monotonic() - self._t_start

    def trainer_state(self) -> dict:
        return {"step": self.step, "planned_steps": self.total, "losses": self.losses, "evals": self.evals,
                "train_seconds": self.seconds(), "config": asdict(self.config), **self.task.state()}

    def _restore(self) -> None:
        directory = self.checkpoints.latest() if self.checkpoints is not None else None
        if directory is None:
            return
        self.task.load_weights(directory)
        self.opt.load_state_dict(torch.load(directory / OPTIMIZER, weights_only=True))
        meta = json.loads((directory / self.checkpoints.meta).read_text())
        self.step, self.losses, self.evals = meta["step"], meta["losses"], meta.get("evals", [])
        self.before = meta.get("train_seconds", 0.0)  # absent in checkpoints of early versions
        self.task.load_state(meta)
        self._saved = self.step
        self._evaluated = self.evals[-1]["step"] if self.evals else None

    def save_checkpoint(self) -> None:
        """Write a checkpoint of the current step (main process only; no-op without checkpoints)."""
        if self.checkpoints is None or not self.acc.is_main_process:
            return

        def fill(directory: Path) -> None:
            self.task.save_weights(directory)
            atomic_write(directory / OPTIMIZER, lambda tmp: torch.save(self.opt.state_dict(), tmp))

        self.checkpoints.write(self.step, fill, self.trainer_state())
        self._saved = self.step

    def _evaluate(self) -> None:
        """Run task.evaluate once per step (on every process, in step with each other) and keep its record."""
        if self._evaluated == self.step:
            return
        self._evaluated = self.step
        result = self.task.evaluate(self)
        if result is not None:
            self.evals.append({"step": self.step, **result})
            shown = {k: f"{v:.4f}" for k, v in result.items() if isinstance(v, float)}
            self.bar.set_postfix(loss=f"{self.losses[-1]:.4f}" if self.losses else "-", **shown, refresh=False)
        self.acc.wait_for_everyone()

    def _one_step(self) -> None:
        micros = self.task.micro_batches(self, self.step)
        self.opt.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.acc.device)
        for i, micro in enumerate(micros):
            # gradients are all-reduced once per step, with the last micro-batch's backward
            with self.acc.no_sync(self.model) if i < len(micros) - 1 else nullcontext():
                loss = self.task.loss(self, micro)
                self.acc.backward(self.scaler.scale(loss))
            total += loss.detach().float()
        if self.config.max_grad_norm is not None:
            self.scaler.unscale_(self.opt)
            self.acc.clip_grad_norm_(self.params, self.config.max_grad_norm)
        self.scaler.step(self.opt)
        self.scaler.update()
        self.step += 1
        self.losses.append(global_mean(total, self.acc))

    def fit(self, deadline: float | None = None, resume: bool = True, stop_after: int | None = None) -> Trainer:
        """Train from the newest checkpoint (when `resume`) up to `task.total_steps`.

        deadline: a time.monotonic() value after which no step starts; the cosine decay then follows
        the larger of steps done and time spent (`set_lr`), and every process takes the main
        process's clock (distill.accel.synced_clock). stop_after: end this call after that many steps
        in all (the schedule still spans total_steps; a later call resumes). A checkpoint is written
        every `checkpoint_every` steps and, in a `finally`, when the loop ends or is stopped.
        """
        task, cfg, acc = self.task, self.config, self.acc
        if resume:
            self._restore()
        self.model, self.opt = acc.prepare(self.model, self.opt)
        self.raw = acc.unwrap_model(self.model)
        task.begin(self)
        last = self.total if stop_after is None else min(self.total, stop_after)
        self.bar = progress(total=self.total, initial=min(self.step, self.total), desc=task.desc, unit="step",
                            disable=not acc.is_local_main_process)
        self._t_start = time.monotonic()
        if task.eval_every and self.step == 0:
            self._evaluate()  # the untrained weights: the curve's first point
        try:
            while self.step < last:
                seconds, step_deadline, stop = synced_clock(acc, self.seconds(), deadline)
                if stop:  # every process stops at the same step
                    break
                set_lr(self.opt, self.step, self.total, seconds, step_deadline, cfg)
                self._one_step()
                task.end_step(self)
                self.bar.set_postfix(loss=f"{self.losses[-1]:.4f}", refresh=False)  # drawn at the bar's interval
                self.bar.update(1)
                if task.eval_every and (self.step % task.eval_every == 0 or self.step == self.total):
                    self._evaluate()
                if self.step % cfg.checkpoint_every == 0:
                    self.save_checkpoint()
        finally:  # also when stopped (Ctrl-C, SIGTERM): the steps done so far are kept
            self.bar.close()
            if self.step and self._saved != self.step:
                self.save_checkpoint()
        if self.step == 0 and last > 0:  # only the deadline ends a fit before its first step
            raise ValueError(out_of_time("the first training step"))
        if task.eval_every:
            self._evaluate()  # the final weights, when the last measurement was earlier
        return self

    def report(self, metrics: dict, panels: Sequence[Panel] = ()) -> dict:
        """The metrics of this training: `metrics` after steps, planned_steps, final_loss,
        train_seconds and config. The main process writes them to OUT/<task.metrics_file> and the
        loss curve (with `panels` beside it) to OUT/<task.plot_file>; every process then waits."""
        window = self.losses[-self.task.final_window:]
        out = {"steps": self.step, "planned_steps": self.total, **metrics,
               "final_loss": sum(window) / len(window) if window else None,
               "train_seconds": self.seconds(), "config": asdict(self.config)}
        if self.out_dir is not None and self.acc.is_main_process:
            if self.losses:
                plot(self.losses, self.task.loss_label, self.task.desc, panels, self.out_dir / self.task.plot_file)
            atomic_write_text(self.out_dir / self.task.metrics_file, json.dumps(out, indent=1))
        self.acc.wait_for_everyone()
        return out


@dataclass
class Panel:
    """A panel of the training plot beside the loss: lines of (x, y, label); `twin` lines go on a
    second y axis labelled `twin_label`."""

    title: str
    ylabel: str
    lines: list[tuple[list, list, str]]
    twin: list[tuple[list, list, str]] = dataclasses.field(default_factory=list)
    twin_label: str = ""
    marker: str | None = None


def series(evals: Sequence[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of `key` in the evaluation records that hold it: a line to plot."""
    kept = [e for e in evals if key in e]
    return [e["step"] for e in kept], [e[key] for e in kept]


def running_mean(values: Sequence[float]) -> tuple[list[int], list[float]]:
    """The mean over windows of len // 50 values (at least 1), NaN skipped: (x, y) to plot."""
    w = max(1, len(values) // 50)
    x = torch.tensor([float("nan") if v is None else v for v in values], dtype=torch.float64)
    return list(range(w - 1, len(values))), x.unfold(0, w, 1).nanmean(-1).tolist()


def plot(losses: list[float], ylabel: str, title: str, panels: Sequence[Panel], path: Path) -> None:
    """The loss per step and its running mean, then each panel to its right, written atomically as PNG."""
    import matplotlib  # heavy (matplotlib): loaded only to draw the plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): no display backend

    fig, axes = plt.subplots(1, 1 + len(panels), figsize=(6 if not panels else 5 * (1 + len(panels)), 3.5),
                             squeeze=False)
    left = axes[0][0]
    left.plot(losses, lw=0.6, alpha=0.4, label="step")
    left.plot(*running_mean(losses), lw=1.5, label="running mean")
    left.set(xlabel="step", ylabel=ylabel, title=title)
    left.legend()
    for ax, panel in zip(axes[0][1:], panels):
        for x, y, label in panel.lines:
            ax.plot(x, y, marker=panel.marker, label=label)
        ax.set(xlabel="step", ylabel=panel.ylabel, title=panel.title)
        twin_lines = [line for line in panel.twin if line[0]]
        if twin_lines:
            twin = ax.twinx()
            for x, y, label in twin_lines:
                twin.plot(x, y, marker="s", color="C1", label=label)
            twin.set_ylabel(panel.twin_label)
        if any(label for _, _, label in panel.lines):
            ax.legend()
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    plt.close(fig)
