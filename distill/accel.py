"""Several processes: what the training loops of distill/ share to run unchanged under `accelerate launch`.

    accelerate launch --multi_gpu --num_processes 8 -m specdec.cli medusa train ...   # 8 GPUs, NCCL
    accelerate launch --multi_gpu --num_processes 2 recipes/recover_smollm2_24.py ...  # no GPU: 2 CPU processes, gloo

(accelerate's `--cpu` launcher needs MPI for more than one process; without it each process
would train alone. `--multi_gpu` on a machine without GPUs starts torch.distributed over gloo.)

One process is the same as before: the Accelerator is a plain device holder and every helper
here is the identity. With N processes accelerate wraps the trained module in DDP:

- `Forward` routes a loop's training forward through one module call, so that DDP (which
  synchronises gradients only for work done inside its own `forward`) sees it even where the loop
  calls several methods of the trained module.
- `local_part` gives each process its contiguous slice of the global batch (the batch the config
  names stays the global one) and the weight that makes DDP's mean of the per-process gradients
  the gradient of the global batch's mean loss, whatever the slice sizes; a process whose slice
  is empty still runs a step (on one item, weight 0) so that no all-reduce is left waiting.
- `count_weights` does the same for losses that are means over a varying number of rows per
  group (EAGLE-3's unrolled steps), with one all-reduce of the row counts.
- `global_mean` is the logged loss of the whole batch; `synced_clock` makes every process take
  the main process's view of the time budget, so they stop at the same step and follow the same
  deadline-aware learning-rate schedule (parameters stay identical across replicas).
Only the main process writes checkpoints, plots and metrics (`acc.is_main_process`);
`close_process_group` ends the process group when a command or recipe is done.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from runtime.hardware import native_bf16


def close_process_group() -> None:
    """End torch.distributed's process group if this process joined one (under `accelerate launch`):
    gloo's threads must stop before the interpreter does, or it can abort at exit after the work is
    written. A no-op in a single process; the CLI and the recipes call it on their way out."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def autocast_mode(mixed_precision: str, device: torch.device) -> str:
    """accelerate's mixed_precision for training on `device`: `mixed_precision` as given, except
    "auto", which is "bf16" where the hardware multiplies bf16 natively (runtime.hardware.native_bf16)
    and "no" (float32) elsewhere."""
    if mixed_precision != "auto":
        return mixed_precision
    return "bf16" if native_bf16(device) else "no"


class Forward(nn.Module):
    """`Forward(module, fn)(*args)` = `fn(module, *args)`, a training step's forward as one call of a
    module that owns `module`'s parameters (what accelerate's DDP wrapper needs to sync them)."""

    def __init__(self, module: nn.Module, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.module = module
        self.fn = fn

    def forward(self, *args, **kwargs):
        return self.fn(self.module, *args, **kwargs)


def local_part(n: int, acc) -> tuple[slice, float]:
    """This process's part of a global batch of `n` items: a slice of it and the loss weight.

    The slices are contiguous and cover the batch (sizes differ by at most one). weight =
    n_local * num_processes / n, so that the mean over processes of weight * (mean loss over the
    local items), which DDP's gradient averaging computes, is the mean over all n items. An empty
    slice becomes the first item with weight 0.
    """
    if n < 1:
        raise ValueError(f"a training batch needs at least one item, got {n}")
    world, rank = acc.num_processes, acc.process_index
    lo, hi = rank * n // world, (rank + 1) * n // world
    if hi == lo:
        return slice(0, 1), 0.0
    return slice(lo, hi), (hi - lo) * world / n


def local_items(items: Sequence, acc) -> tuple[Sequence, float]:
    """`local_part` applied to a list (e.g. the record ids of one batch): (this process's items, weight)."""
    part, weight = local_part(len(items), acc)
    return items[part], weight


def count_weights(counts: Sequence[int], acc) -> list[float] | None:
    """Loss weights for per-group means over rows (e.g. the unrolled steps of EAGLE-3): group g's
    weight is its local row count * num_processes / its row count over all processes, so DDP's
    mean of the weighted per-process losses is the loss of the global batch. None with one process
    (no weighting). One all-reduce of len(counts) numbers."""
    if acc.num_processes == 1:
        return None
    local = torch.tensor([float(c) for c in counts], device=acc.device)
    total = acc.reduce(local.clone(), reduction="sum")
    return (local * acc.num_processes / total.clamp(min=1)).tolist()


def global_mean(value: torch.Tensor, acc) -> float:
    """The mean over processes of a scalar tensor (each process's weighted loss): the global batch's loss."""
    if acc.num_processes == 1:
        return float(value.detach())
    return float(acc.reduce(value.detach().float().reshape(1), reduction="mean"))


def synced_clock(acc, seconds: float, deadline: float | None) -> tuple[float, float | None, bool]:
    """(training seconds, deadline, stop) as the main process sees them, on every process.

    seconds: this process's training seconds so far; deadline: its time.monotonic() deadline (None:
    none). stop is True when the main process is past the deadline. With one process (or no
    deadline) the values are returned as they are.
    """
    if deadline is None:
        return seconds, None, False
    if acc.num_processes == 1:
        return seconds, deadline, time.monotonic() > deadline
    from accelerate.utils import broadcast  # heavy (accelerate): loaded when training starts, not at CLI start

    now = time.monotonic()
    t = torch.tensor([seconds, deadline - now], dtype=torch.float64, device=acc.device)
    t = broadcast(t, from_process=0)
    left = float(t[1])
    return float(t[0]), now + left, left < 0
