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
  embeddings and any dense linear stay frozen. float32 master weights, `accelerate` for device,
  bf16 autocast where the hardware multiplies it natively, gradient accumulation (micro-batches
  of `micro_batch` windows), several processes (distill.accel), AdamW, warm-up + cosine (the
  deadline-aware schedule of distill.train_medusa), gradient clipping.
- Long-job frame: a progress bar, held-out perplexity every `eval_every` steps, atomic
  checkpoints in OUT/checkpoint every `checkpoint_every` steps and when stopped, resume from them,
  a deadline, OUT/recovery.png (loss and held-out perplexity) and OUT/metrics.json.
"""

from __future__ import annotations

import json
import math
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from distill.accel import autocast_mode, global_mean, local_part, synced_clock
from distill.config_args import at_least, check_fields, positive
from distill.divergence import token_divergence
from distill.train_medusa import set_lr
from runtime.atomic import atomic_write, atomic_write_text
from runtime.outputs import prepare_output_dir
from runtime.progress import progress
from runtime.qlinear import QuantizedLinear, Sparse24Int4Linear, Sparse24Linear, unpack_24_indices

CHECKPOINT, TRAINER = "checkpoint", "recover_trainer.json"
# files that mark a recovery directory: one of them there and training resumes in it
RECOVER_MARKERS = (f"{CHECKPOINT}/{TRAINER}", "metrics.json", "budget.json")


@dataclass(frozen=True)
class RecoverConfig:
    """Hyper-parameters of `recover`; `specdec distill recover` derives its flags from these fields."""

    steps: int = field(default=2000, metadata={"help": "optimizer steps (the deadline may stop training earlier)",
                                               "check": at_least(1)})
    batch_size: int = field(default=8, metadata={"help": "windows per optimizer step, over all processes",
                                                 "check": at_least(1)})
    micro_batch: int = field(default=2, metadata={
        "help": "windows per forward pass: a step accumulates gradients over batch_size / processes / micro_batch "
                "passes (lower it when memory is short)", "check": at_least(1)})
    lr: float = field(default=5e-5, metadata={"help": "peak AdamW learning rate (warm-up, then cosine decay)",
                                              "check": positive})
    warmup_steps: int = field(default=20, metadata={"help": "steps of linear learning-rate warm-up",
                                                    "check": at_least(0)})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay", "check": at_least(0)})
    max_grad_norm: float = field(default=1.0, metadata={"help": "gradient clipping norm", "check": positive})
    temperature: float = field(default=1.0, metadata={"help": "distillation temperature of both distributions",
                                                      "check": positive})
    ce_weight: float = field(default=0.0, metadata={
        "help": "weight of the next-token cross-entropy on the data added to the KL (0 = pure distillation)",
        "check": at_least(0)})
    train_norms: bool = field(default=True, metadata={"help": "train the RMSNorm weights as well as the kept "
                                                              "values of the sparse linears"})
    eval_every: int = field(default=50, metadata={"help": "steps between held-out perplexity measurements",
                                                  "check": at_least(1)})
    checkpoint_every: int = field(default=50, metadata={"help": "steps between resumable checkpoints",
                                                        "check": at_least(1)})
    mixed_precision: str = field(default="auto", metadata={
        "help": "autocast mode of training; auto: bf16 where the hardware multiplies it natively, else float32",
        "choices": ("auto", "no", "bf16")})
    seed: int = field(default=0, metadata={"help": "seed of the window order"})

    def __post_init__(self) -> None:
        check_fields(self)

    def autocast_mode(self, device: torch.device) -> str:
        """accelerate's mixed_precision for training on `device` ("auto" resolved)."""
        return autocast_mode(self.mixed_precision, device)


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
    take gradient updates; recover the 2:4 model first, then quantize it.
    """
    found = {}
    for name, mod in list(model.named_modules()):
        if isinstance(mod, Sparse24Int4Linear) or (isinstance(mod, QuantizedLinear)
                                                   and not isinstance(mod, Sparse24Linear)):
            raise ValueError(f"{name} is a {type(mod).__name__}: recover trains 2:4 students with 16-bit kept "
                             "values (Sparse24Linear); sparsify without int4_group_size, recover, then quantize")
        if isinstance(mod, Sparse24Linear):
            found[name] = MaskedSparse24(mod).to(mod.values.device)
            model.set_submodule(name, found[name])
    if not found:
        raise ValueError("the student has no 2:4-sparse linears; prune it first with "
                         "quant.sparsify_(model, quant.SemiStructured24(...))")
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


def _check_windows(name: str, windows: torch.Tensor | None) -> None:
    if windows is None:
        return
    if not isinstance(windows, torch.Tensor) or windows.dim() != 2 or windows.dtype != torch.long \
            or windows.shape[1] < 2:
        what = f"{windows.dtype} {tuple(windows.shape)}" if isinstance(windows, torch.Tensor) else type(windows)
        raise ValueError(f"{name} must be a LongTensor (N, T) of token windows with T >= 2 (quant.calibration_batches "
                         f"gives them), got {what}")


def _save_checkpoint(ckpt: Path, params: dict[str, nn.Parameter], opt, state: dict) -> None:
    ckpt.mkdir(parents=True, exist_ok=True)
    tensors = {n: p.detach().cpu().contiguous() for n, p in params.items()}
    atomic_write(ckpt / "trained.safetensors", lambda tmp: save_file(tensors, tmp))
    atomic_write(ckpt / "optimizer.pt", lambda tmp: torch.save(opt.state_dict(), tmp))
    atomic_write_text(ckpt / TRAINER, json.dumps(state))


def _plot(losses: list[float], evals: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
    a.plot(losses, lw=0.6, alpha=0.4, label="batch")
    w = max(1, len(losses) // 50)
    smooth = torch.tensor(losses).unfold(0, w, 1).mean(-1).tolist()
    a.plot(range(w - 1, len(losses)), smooth, lw=1.5, label=f"mean of {w}")
    a.set_xlabel("step")
    a.set_ylabel("distillation loss")
    a.legend()
    if evals:
        b.plot([e["step"] for e in evals], [e["perplexity"] for e in evals], marker="o")
    b.set_xlabel("step")
    b.set_ylabel("held-out perplexity")
    fig.suptitle("2:4 recovery by distillation")
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    plt.close(fig)


def recover(student: nn.Module, teacher: nn.Module, data: torch.Tensor, config: RecoverConfig = RecoverConfig(),
            out_dir: str | Path | None = None, *, heldout: torch.Tensor | None = None,
            deadline: float | None = None, resume: bool = True) -> dict:
    """Distil the dense runtime model `teacher` into the 2:4-sparse runtime model `student`, in place.

    data: LongTensor (N, T) training windows (quant.calibration_batches: ShareGPT, code or both);
    heldout: (M, T) windows whose perplexity is measured every `eval_every` steps and at the end
    (never trained on). The student keeps its 2:4 structure exactly (module docstring) and its
    dtype; it is in eval mode on return and saves with quant.save_compressed.
    out_dir: new, empty or a recovery directory (resumed from when `resume`); it receives the
    checkpoints, recovery.png and metrics.json. Without it nothing is written.
    deadline: a time.monotonic() value at which training stops (the final evaluation still runs);
    the cosine decay then follows the time spent (distill.train_medusa.set_lr).
    Returns the metrics (steps, losses, held-out perplexities, seconds, config).
    """
    from accelerate import Accelerator

    _check_windows("data", data)
    _check_windows("heldout", heldout)
    if teacher.config.vocab_size != student.config.vocab_size:
        raise ValueError(f"teacher vocabulary {teacher.config.vocab_size} != student vocabulary "
                         f"{student.config.vocab_size}: recover distils a model into its own compressed copy")
    if out_dir is not None:
        out_dir = check_recover_dir(out_dir)
    device, dtype = student.device, student.dtype
    # bf16 autocast applied here, not through accelerate's process-wide mixed-precision state, which
    # refuses a second setting in one process (another training loop run before this one)
    acc = Accelerator(cpu=device.type == "cpu")
    bf16 = config.autocast_mode(device) == "bf16"
    if out_dir is not None and acc.is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)
    unmask_sparse(student)
    student.float().to(acc.device).train()
    teacher.to(acc.device).eval().requires_grad_(False)
    params = _trained(student, config)
    opt = torch.optim.AdamW(list(params.values()), lr=config.lr, weight_decay=config.weight_decay)
    ckpt = out_dir / CHECKPOINT if out_dir is not None else None
    step, losses, evals, before = 0, [], [], 0.0  # before: training seconds of earlier runs of this job
    if resume and ckpt is not None and (ckpt / TRAINER).is_file():
        saved = load_file(str(ckpt / "trained.safetensors"))
        if set(saved) != set(params) or any(saved[n].shape != p.shape for n, p in params.items()):
            raise ValueError(f"{ckpt} holds the trained tensors of another student or configuration; use another "
                             "output directory")
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(saved[n])
        opt.load_state_dict(torch.load(ckpt / "optimizer.pt", weights_only=True))
        meta = json.loads((ckpt / TRAINER).read_text())
        step, losses, evals, before = meta["step"], meta["losses"], meta["evals"], meta["train_seconds"]
    model, opt = acc.prepare(student, opt)
    N, T = data.shape
    per_epoch = max(1, N // config.batch_size)
    bar = progress(total=config.steps, initial=min(step, config.steps), desc="recovering 2:4 model", unit="step",
                   disable=not acc.is_local_main_process)
    t_start = time.monotonic()

    def seconds() -> float:
        return before + time.monotonic() - t_start

    def state() -> dict:
        return {"step": step, "losses": losses, "evals": evals, "train_seconds": seconds(), "config": asdict(config)}

    def evaluate() -> None:
        if heldout is not None and (not evals or evals[-1]["step"] != step):
            student.eval()
            evals.append({"step": step, "perplexity": window_perplexity(student, heldout, config.micro_batch)})
            student.train()

    positions = torch.arange(T, device=acc.device)
    try:
        if step == 0:
            evaluate()
        while step < config.steps:
            secs, dl, stop = synced_clock(acc, seconds(), deadline)
            if stop:
                break
            epoch, b = divmod(step, per_epoch)
            order = torch.randperm(N, generator=torch.Generator().manual_seed(config.seed + epoch))
            batch = data[order[b * config.batch_size:(b + 1) * config.batch_size]]  # (batch, T), global
            part, weight = local_part(batch.shape[0], acc)
            local = batch[part].to(acc.device)  # (n, T)
            set_lr(opt, step, config.steps, secs, dl, config)
            opt.zero_grad(set_to_none=True)
            chunks = local.split(config.micro_batch)
            total = torch.zeros((), device=acc.device)
            for i, tokens in enumerate(chunks):
                with torch.no_grad():
                    target = teacher(tokens, positions.expand_as(tokens), None).logits  # (b, T, V)
                scale = weight * tokens.shape[0] / local.shape[0]
                sync = acc.no_sync(model) if i < len(chunks) - 1 else nullcontext()
                with sync:
                    with torch.autocast(acc.device.type, dtype=torch.bfloat16, enabled=bf16):
                        logits = model(tokens, positions.expand_as(tokens), None).logits  # (b, T, V)
                    loss = kd_loss(logits, target, tokens, config.temperature, config.ce_weight) * scale
                    acc.backward(loss)
                total += loss.detach()
                del target, logits
            acc.clip_grad_norm_(list(params.values()), config.max_grad_norm)
            opt.step()
            step += 1
            losses.append(global_mean(total, acc))
            bar.set_postfix(loss=f"{losses[-1]:.4f}", refresh=False)
            bar.update(1)
            if step % config.eval_every == 0:
                evaluate()
                bar.set_postfix(loss=f"{losses[-1]:.4f}", ppl=f"{evals[-1]['perplexity']:.2f}", refresh=False)
            if ckpt is not None and acc.is_main_process and step % config.checkpoint_every == 0:
                _save_checkpoint(ckpt, params, opt, state())
    finally:  # also when stopped (Ctrl-C, SIGTERM): the steps done so far are kept
        bar.close()
        if ckpt is not None and acc.is_main_process:
            _save_checkpoint(ckpt, params, opt, state())
    evaluate()
    student = acc.unwrap_model(model)
    mask_sparse(student, dtype)
    student.to(dtype).eval().requires_grad_(False)
    metrics = {"steps": step, "planned_steps": config.steps, "train_windows": N, "window_tokens": T,
               "heldout_windows": 0 if heldout is None else heldout.shape[0],
               "processes": acc.num_processes, "losses": losses, "evals": evals,
               "final_loss": sum(losses[-20:]) / len(losses[-20:]) if losses else None,
               "train_seconds": seconds(), "config": asdict(config)}
    if out_dir is not None and acc.is_main_process:
        if losses:
            _plot(losses, evals, out_dir / "recovery.png")
        atomic_write_text(out_dir / "metrics.json", json.dumps(metrics, indent=1))
    acc.wait_for_everyone()
    return metrics
