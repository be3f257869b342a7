"""Recovery of a 2:4-sparse model by distillation from its dense original (`distill.recover`).

Pruning to 2:4 (quant.sparsify_, SparseGPT) costs quality; every production 2:4 recipe wins
much of it back by training the sparse model toward the dense one. Here:

- Structure kept by construction: each `runtime.qlinear.Sparse24Linear` of the student becomes a
  `MaskedSparse24` for training, whose parameter is the (out, in/2) tensor of kept values; its
  dense weight is those values scattered to their fixed positions. Gradients and updates only
  ever touch kept weights, so after training every group of four inputs still holds at most two
  nonzeros at the positions the pruning chose, and the module turns back into a Sparse24Linear
  with the same indices (`quant.save_compressed` then `runtime.load_model` round-trips it).
- Loss: token-level KL(teacher || student) over the whole vocabulary at a distillation
  temperature (times T^2), plus optionally `ce_weight` times the next-token cross-entropy on the
  window's own tokens. The dense teacher's logits are computed once per micro-batch under no_grad.
- Trained: the kept values and biases of the sparse linears, and the norm weights (`train_norms`);
  embeddings and any dense linear stay frozen. float32 master weights; gradients accumulate over
  micro-batches of `micro_batch` windows.
- The loop is `distill.trainer`'s (`RecoverTask`: AdamW, warm-up + cosine, clipping, autocast,
  several processes, checkpoints in OUT/checkpoint and resume, a deadline): held-out perplexity
  every `eval_every` steps, OUT/recovery.png (loss and held-out perplexity) and OUT/metrics.json.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from distill.accel import local_part
from distill.config_args import at_least, positive
from distill.divergence import token_divergence
from distill.trainer import CheckpointDir, Panel, Task, Trainer, TrainerConfig, series, trainer_field
from runtime.atomic import atomic_write
from runtime.output_paths import created_output, prepare_output_dir
from runtime.qlinear import QuantizedLinear, Sparse24Int4Linear, Sparse24Linear, unpack_24_indices

CHECKPOINT, TRAINER = "checkpoint", "recover_trainer.json"
# files that mark a recovery directory: one of them there and training resumes in it
RECOVER_MARKERS = (f"{CHECKPOINT}/{TRAINER}", "metrics.json", "budget.json")


@dataclass(frozen=True)
class RecoverConfig(TrainerConfig):
    """Hyper-parameters of `recover`; `specdec distill recover` derives its flags from these fields (the
    shared ones, lr to seed, are distill.trainer.TrainerConfig's)."""

    lr: float = trainer_field("lr", 5e-5)
    max_grad_norm: float | None = trainer_field("max_grad_norm", 1.0)
    checkpoint_every: int = trainer_field("checkpoint_every", 50)
    steps: int = field(default=2000, metadata={"help": "optimizer steps (the deadline may stop training earlier)",
                                               "check": at_least(1)})
    batch_size: int = field(default=8, metadata={"help": "windows per optimizer step, over all processes",
                                                 "check": at_least(1)})
    micro_batch: int = field(default=2, metadata={
        "help": "windows per forward pass: a step accumulates gradients over batch_size / processes / micro_batch "
                "passes (lower it when memory is short)", "check": at_least(1)})
    temperature: float = field(default=1.0, metadata={"help": "distillation temperature of both distributions",
                                                      "check": positive})
    ce_weight: float = field(default=0.0, metadata={
        "help": "weight of the next-token cross-entropy on the data added to the KL (0 = pure distillation)",
        "check": at_least(0)})
    train_norms: bool = field(default=True, metadata={"help": "train the RMSNorm weights as well as the kept "
                                                              "values of the sparse linears"})
    eval_every: int = field(default=50, metadata={"help": "steps between held-out perplexity measurements",
                                                  "check": at_least(1)})


class MaskedSparse24(nn.Module):
    """Trainable form of a Sparse24Linear: kept values (out, in/2) as a float32 parameter, positions fixed."""

    def __init__(self, mod: Sparse24Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = mod.in_features, mod.out_features
        self.values = nn.Parameter(mod.values.detach().float().clone())  # (N, K/2)
        self.bias = None if mod.bias is None else nn.Parameter(mod.bias.detach().float().clone())
        self.register_buffer("indices", mod.indices.clone())  # (N, K/8) uint8, as stored
        self.register_buffer("positions", unpack_24_indices(mod.indices))  # (N, K/4, 2)

    def weight(self) -> torch.Tensor:
        """The dense (out, in) weight: the kept values at their positions, zeros elsewhere."""
        N, K = self.out_features, self.in_features
        dense = self.values.new_zeros(N, K // 4, 4)
        return dense.scatter(-1, self.positions, self.values.view(N, K // 4, 2)).view(N, K)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) -> (..., out)."""
        return F.linear(x, self.weight(), self.bias)

    def to_sparse(self, dtype: torch.dtype) -> Sparse24Linear:
        """The Sparse24Linear with these values (in `dtype`) and the original indices."""
        bias = None if self.bias is None else self.bias.detach().to(dtype).clone()
        return Sparse24Linear(self.values.detach().to(dtype).contiguous(), self.indices.clone(), bias)


def unmask_sparse(model: nn.Module) -> dict[str, MaskedSparse24]:
    """Replace every Sparse24Linear of `model` by a MaskedSparse24 in place; returns them by name.

    Fails for other compressed linears (INT4 / INT8 / 2:4 with INT4 values): their codes cannot
    take gradient updates; recover the 2:4 model first, then quantize it. A model it refuses is left
    unchanged.
    """
    sparse = []
    for name, mod in model.named_modules():  # every module checked before the first is replaced
        if isinstance(mod, Sparse24Int4Linear) or (isinstance(mod, QuantizedLinear)
                                                   and not isinstance(mod, Sparse24Linear)):
            raise ValueError(f"{name} is a {type(mod).__name__}: recover trains 2:4 students with 16-bit kept "
                             "values (Sparse24Linear); sparsify without int4_group_size, recover, then quantize")
        if isinstance(mod, Sparse24Linear):
            sparse.append((name, mod))
    if not sparse:
        raise ValueError("the student has no 2:4-sparse linears; prune it first with "
                         "quant.sparsify_(model, quant.SemiStructured24(...))")
    found = {}
    for name, mod in sparse:
        found[name] = MaskedSparse24(mod).to(mod.values.device)
        model.set_submodule(name, found[name])
    return found


def mask_sparse(model: nn.Module, dtype: torch.dtype) -> None:
    """Turn every MaskedSparse24 of `model` back into a Sparse24Linear (values in `dtype`) in place."""
    for name, mod in list(model.named_modules()):
        if isinstance(mod, MaskedSparse24):
            model.set_submodule(name, mod.to_sparse(dtype))


def kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, tokens: torch.Tensor,
            temperature: float = 1.0, ce_weight: float = 0.0) -> torch.Tensor:
    """Mean over the predicted positions of T^2 * KL(p_T || q_T) + ce_weight * CE.

    student_logits, teacher_logits (B, T, V) at positions 0 .. T-1; tokens (B, T). p_T / q_T are
    the teacher's / student's softmax at temperature T; the CE scores tokens[:, 1:] from
    positions 0 .. T-2 at temperature 1 (the KL covers every position).
    """
    V = student_logits.shape[-1]
    kl = token_divergence(student_logits.reshape(-1, V), teacher_logits.reshape(-1, V), "fkl",
                          temperature).mean() * temperature ** 2  # over (B*T,) positions
    if not ce_weight:
        return kl
    ce = F.cross_entropy(student_logits[:, :-1].float().reshape(-1, V), tokens[:, 1:].reshape(-1))
    return kl + ce_weight * ce


@torch.no_grad()
def window_perplexity(model: nn.Module, windows: torch.Tensor, micro_batch: int = 4) -> float:
    """exp of the token-weighted mean next-token NLL of runtime `model` over LongTensor (N, T) windows."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for lo in range(0, windows.shape[0], micro_batch):
        tokens = windows[lo:lo + micro_batch].to(device)  # (b, T)
        positions = torch.arange(tokens.shape[1], device=device).expand_as(tokens)
        logits = model(tokens, positions, None).logits  # (b, T, V)
        total += float(F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                       tokens[:, 1:].reshape(-1), reduction="sum"))
        count += tokens[:, 1:].numel()
    return math.exp(total / count)


def check_recover_dir(out_dir: str | Path) -> Path:
    """Fail (OutputPathError) unless `out_dir` is new, empty or a recovery directory (resumed)."""
    return prepare_output_dir(out_dir, RECOVER_MARKERS, what="recovery directory", resume=True)


def _trained(student: nn.Module, config: RecoverConfig) -> dict[str, nn.Parameter]:
    """The parameters recovery trains, by name: kept values and biases of the sparse linears, norms."""
    out = {}
    for name, p in student.named_parameters():
        sparse = name.endswith(".values") or (name.endswith(".bias") and isinstance(
            student.get_submodule(name.rpartition(".")[0]), MaskedSparse24))
        norm = config.train_norms and name.endswith("norm.weight")
        p.requires_grad_(sparse or norm)
        if sparse or norm:
            out[name] = p
    return out


def _check_windows(name: str, windows: torch.Tensor | None, vocab_size: int) -> None:
    """ValueError unless `windows` (None allowed) is a LongTensor (N, T), N >= 1, T >= 2, of ids in [0, vocab_size)."""
    if windows is None:
        return
    if not isinstance(windows, torch.Tensor) or windows.dim() != 2 or windows.dtype != torch.long \
            or windows.shape[0] < 1 or windows.shape[1] < 2:
        what = f"{windows.dtype} {tuple(windows.shape)}" if isinstance(windows, torch.Tensor) else type(windows)
        raise ValueError(f"{name} must be a LongTensor (N, T) of token windows with N >= 1 and T >= 2 "
                         f"(quant.calibration_batches gives them), got {what}")
    lo, hi = int(windows.min()), int(windows.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"{name} holds token id {lo if lo < 0 else hi}, outside the student's vocabulary "
                         f"[0, {vocab_size}): windows tokenized for another model?")


class RecoverTask(Task):
    """2:4 recovery for distill.trainer: shuffled batches of windows split into micro-batches, the KD
    loss against the dense teacher, held-out perplexity every `eval_every` steps, the trained tensors
    as the checkpoint's trained.safetensors."""

    desc = "recovering 2:4 model"
    plot_file = "recovery.png"
    loss_label = "distillation loss"
    final_window = 20

    def __init__(self, student: nn.Module, teacher: nn.Module, params: dict[str, nn.Parameter], data: torch.Tensor,
                 heldout: torch.Tensor | None, config: RecoverConfig) -> None:
        self.student, self.teacher, self.named, self.data, self.heldout = student, teacher, params, data, heldout
        self.config, self.total_steps, self.eval_every = config, config.steps, config.eval_every
        self.per_epoch = max(1, data.shape[0] // config.batch_size)

    def module(self) -> nn.Module:
        return self.student

    def parameters(self) -> list[nn.Parameter]:
        return list(self.named.values())

    def micro_batches(self, run: Trainer, step: int) -> list[tuple[torch.Tensor, float]]:
        cfg = self.config
        epoch, b = divmod(step, self.per_epoch)
        order = torch.randperm(self.data.shape[0], generator=torch.Generator().manual_seed(cfg.seed + epoch))
        batch = self.data[order[b * cfg.batch_size:(b + 1) * cfg.batch_size]]  # (batch, T), global
        part, weight = local_part(batch.shape[0], run.acc)
        local = batch[part].to(run.acc.device)  # (n, T)
        return [(tokens, weight * tokens.shape[0] / local.shape[0]) for tokens in local.split(cfg.micro_batch)]

    def loss(self, run: Trainer, micro: tuple[torch.Tensor, float]) -> torch.Tensor:
        tokens, scale = micro  # (b, T)
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        with torch.no_grad():
            target = self.teacher(tokens, positions, None).logits  # (b, T, V)
        with run.autocast():
            logits = run.model(tokens, positions, None).logits  # (b, T, V)
        return kd_loss(logits, target, tokens, self.config.temperature, self.config.ce_weight) * scale

    def evaluate(self, run: Trainer) -> dict | None:
        if self.heldout is None:
            return None
        self.student.eval()
        result = {"perplexity": window_perplexity(self.student, self.heldout, self.config.micro_batch)}
        self.student.train()
        return result

    def save_weights(self, directory: Path) -> None:
        tensors = {n: p.detach().cpu().contiguous() for n, p in self.named.items()}
        atomic_write(directory / "trained.safetensors", lambda tmp: save_file(tensors, tmp))

    def load_weights(self, directory: Path) -> None:
        saved = load_file(str(directory / "trained.safetensors"))
        if set(saved) != set(self.named) or any(saved[n].shape != p.shape for n, p in self.named.items()):
            raise ValueError(f"{directory} holds the trained tensors of another student or configuration; use "
                             "another output directory")
        with torch.no_grad():
            for n, p in self.named.items():
                p.copy_(saved[n])


def recover(student: nn.Module, teacher: nn.Module, data: torch.Tensor, config: RecoverConfig = RecoverConfig(),
            out_dir: str | Path | None = None, *, heldout: torch.Tensor | None = None,
            deadline: float | None = None, resume: bool = True) -> dict:
    """Distil the dense runtime model `teacher` into the 2:4-sparse runtime model `student`, in place.

    data: LongTensor (N, T) training windows (quant.calibration_batches: ShareGPT, code or both);
    heldout: (M, T) windows whose perplexity is measured every `eval_every` steps and at the end
    (never trained on). The student keeps its 2:4 structure exactly (module docstring) and its
    dtype; it is in eval mode on return and saves with quant.save_compressed.
    out_dir: new, empty or a recovery directory (resumed from when `resume`); it receives the
    checkpoints, recovery.png and metrics.json. Without it nothing is written. The models, the
    windows and `out_dir` are checked before anything is changed or created, and a run that fails
    before its first checkpoint removes a new `out_dir` again.
    deadline: a time.monotonic() value at which training stops (the final evaluation still runs);
    the cosine decay then follows the time spent (distill.trainer.set_lr).
    Returns the metrics (steps, losses, held-out perplexities, seconds, config).
    """
    if teacher.config.vocab_size != student.config.vocab_size:
        raise ValueError(f"teacher vocabulary {teacher.config.vocab_size} != student vocabulary "
                         f"{student.config.vocab_size}: recover distils a model into its own compressed copy")
    _check_windows("data", data, student.config.vocab_size)
    _check_windows("heldout", heldout, student.config.vocab_size)
    if out_dir is not None:
        out_dir = check_recover_dir(out_dir)
    dtype = student.dtype
    unmask_sparse(student)
    student.float().train()
    teacher.eval().requires_grad_(False)
    task = RecoverTask(student, teacher, _trained(student, config), data, heldout, config)
    if out_dir is None:
        return _train(task, config, None, dtype, deadline, resume)
    with created_output(out_dir):  # a run that fails before its first checkpoint leaves no new directory
        return _train(task, config, out_dir, dtype, deadline, resume)


def _train(task: RecoverTask, config: RecoverConfig, out_dir: Path | None, dtype: torch.dtype,
           deadline: float | None, resume: bool) -> dict:
    """`recover`'s training and report for a checked `task`, into `out_dir` (which exists) or
    nowhere; the student goes back to 2:4 linears in `dtype`. Returns the metrics."""
    teacher, data, heldout = task.teacher, task.data, task.heldout
    run = Trainer(task, config, out_dir, CheckpointDir(out_dir / CHECKPOINT, TRAINER) if out_dir is not None else None)
    teacher.to(run.acc.device)
    run.fit(deadline, resume)
    student = run.raw
    mask_sparse(student, dtype)
    student.to(dtype).eval().requires_grad_(False)
    N, T = data.shape
    metrics = run.report({"train_windows": N, "window_tokens": T,
                          "heldout_windows": 0 if heldout is None else heldout.shape[0],
                          "processes": run.acc.num_processes, "losses": run.losses, "evals": run.evals},
                         [Panel("2:4 recovery by distillation", "held-out perplexity",
                                [(*series(run.evals, "perplexity"), "")], marker="o")])
    return metrics
