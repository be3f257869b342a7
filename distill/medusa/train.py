"""Medusa-1 training: heads on a frozen backbone, from last hidden states cached on disk.

1. The hidden-state cache (`distill.data.features`: `cache_hidden_states`, or
   `distill.generate_selfdistill(hidden_cache=...)` while it generates) holds, for every answer
   position t, the final-norm hidden state and the targets of the K heads (token t+2+i for head i),
   split into train and held-out records.
2. `train_medusa` trains the heads for many epochs on those shards (cheap: no backbone pass):
   loss = sum_i 0.8^i CE(head i) (softmax over the whole vocabulary, or, with vocab="data",
   over the tokens the training answers use: 3-5x cheaper on a CPU, and the heads then guess
   among those tokens only) in `distill.trainer`'s loop (`MedusaTask`: AdamW, warm-up + cosine
   decay, checkpoints in OUT/checkpoint and resume, loss.png, metrics.json), then per-head top-k
   accuracy on the held-out shards. The measured accuracy picks the heads' candidate tree
   (`specdec.drafters.medusa.heads.choose_tree`), stored with them by `distill.save_medusa`.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from distill.accel import Forward, count_weights, local_part
from distill.config_args import at_least
from distill.data.features import IGNORE, MANIFEST, MedusaLayout, load_cached
from distill.trainer import CheckpointDir, Task, Trainer, TrainerConfig, out_of_time, trainer_field
from runtime.atomic import atomic_write
from runtime.output_paths import created_output, prepare_output_dir
from specdec.drafters.medusa.heads import DEFAULT_TREE_NODES, MedusaHeads, choose_tree
from specdec.drafters.medusa.io import CONFIG, save_medusa
from specdec.drafters.medusa.tree import expected_length

# files that mark a Medusa training directory (`specdec medusa train --out`, the recipes' OUT):
# one of them there and training resumes in it; a non-empty directory without them is refused
TRAIN_MARKERS = (CONFIG, "checkpoint/trainer.json", f"hidden_cache/{MANIFEST}", "selfdistill.jsonl", "budget.json")


def check_train_dir(out_dir: str | Path) -> Path:
    """Fail (OutputPathError) unless `out_dir` is new, empty or a Medusa training directory."""
    return prepare_output_dir(out_dir, TRAIN_MARKERS, what="Medusa training directory", resume=True)


def data_vocab(targets: torch.Tensor, max_vocab: int = 0) -> torch.Tensor:
    """The token ids (V',) that cached head targets (N, K) hold, sorted: the vocabulary of
    vocab="data"; with `max_vocab` > 0 only the `max_vocab` most frequent of them."""
    ids, counts = torch.unique(targets[targets != IGNORE], return_counts=True)
    if 0 < max_vocab < ids.numel():
        ids = ids[counts.topk(max_vocab).indices].sort().values
    return ids


@torch.no_grad()
def teacher_probs(heads: MedusaHeads, hidden: torch.Tensor, idx: torch.Tensor,
                  vocab: torch.Tensor | None = None) -> torch.Tensor:
    """Soft targets (K, n, V or V') for the positions at rows `idx` of a cached split: for head i,
    the base model's next-token distribution at position t+1+i, which is row idx+1+i (a record's
    positions are consecutive rows). Rows whose head has no target get a neighbour's row: the
    loss masks them."""
    K = heads.num_heads
    fut = (idx[None] + 1 + torch.arange(K)[:, None]).clamp(max=hidden.shape[0] - 1)  # (K, n)
    device = next(heads.parameters()).device
    return heads.base_logits(hidden[fut].to(device, torch.float32), vocab).float().softmax(-1)


def _feature_noise_check(value: float) -> None:
    if not 0 <= value < 10:
        raise ValueError(f"must be a standard deviation relative to the hidden states' RMS: 0 (none) or a small "
                         f"positive number such as 0.1, got {value}")


def _decay_check(value: float) -> None:
    if not 0 < value <= 1:
        raise ValueError(f"must be in (0, 1], got {value}")


@dataclass(frozen=True)
class MedusaTrainConfig(TrainerConfig):
    """Medusa-1 training hyper-parameters: the one declaration of their defaults (the shared ones,
    lr to seed, are distill.trainer.TrainerConfig's).

    `specdec medusa train` and the Medusa recipes derive their flags from these fields
    (`distill.config_args`); each field's `help` is the flag's help text.

    soft_targets: head i at position t learns the base model's next-token distribution at
    position t+1+i (its LM head on the cached hidden state there: the teacher Medusa distils)
    instead of only the greedy token that the answer holds; with vocab="data" the distribution
    is renormalised over the tokens the training answers use.
    max_vocab: with vocab="data", train on (and guess among) only the `max_vocab` most frequent
    target tokens (0 = all of them); targets outside are skipped by the loss and count as misses
    in the held-out accuracy. The softmax over that vocabulary is most of a training step's cost
    and its LM-head rows most of the heads' cost per decoding step.
    mixed_precision: "auto" is bf16 where the device multiplies bf16 natively
    (`runtime.hardware.native_bf16`), else "no" (float32).
    feature_noise: EAGLE's feature augmentation, against heads that over-fit their positions
    (held-out top-1 well below the training positions' within a few epochs).
    """

    lr: float = trainer_field("lr", 2e-3)
    checkpoint_every: int = trainer_field("checkpoint_every", 200)
    epochs: int = field(default=4, metadata={"help": "passes over the cached training positions",
                                             "check": at_least(1)})
    batch_size: int = field(default=512, metadata={"help": "positions per training step", "check": at_least(1)})
    decay: float = field(default=0.8, metadata={"help": "loss weight of head i is decay**i", "check": _decay_check})
    topk: int = field(default=10, metadata={"help": "guesses per head scored in the held-out accuracy table "
                                                    "the tree is built from", "check": at_least(1)})
    tree_nodes: int = field(default=DEFAULT_TREE_NODES, metadata={
        "help": "nodes of the candidate tree built from the held-out accuracy", "check": at_least(1)})
    vocab: str = field(default="full", metadata={
        "help": "softmax over the whole vocabulary, or only over the tokens the training answers use (several "
                "times cheaper on a CPU; the heads then guess among those tokens only)",
        "choices": ("full", "data")})
    max_vocab: int = field(default=0, metadata={
        "help": "with --vocab data: only the N most frequent answer tokens (0 = all; smaller is faster to "
                "train and to draft with)", "check": at_least(0)})
    soft_targets: bool = field(default=False, metadata={
        "help": "learn the model's next-token distribution at each predicted position (its LM head on the "
                "cached hidden state there) instead of only the greedy token"})
    feature_noise: float = field(default=0.0, metadata={
        "help": "standard deviation of Gaussian noise added to the cached hidden states during training, "
                "relative to their RMS (e.g. 0.1; 0 = none): a regulariser for heads that over-fit their data",
        "check": _feature_noise_check})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_vocab and self.vocab != "data":
            raise ValueError(f"MedusaTrainConfig.max_vocab caps the data vocabulary: a token count used with "
                             f"vocab='data', got {self.max_vocab} with vocab={self.vocab!r}")


def medusa_loss(logits: torch.Tensor, targets: torch.Tensor, decay: float,
                teacher: torch.Tensor | None = None,
                head_weights: list[float] | None = None) -> tuple[torch.Tensor, list[float]]:
    """sum_i decay^i CE(logits[i], targets[:, i]) for logits (K, N, V), targets (N, K); a head with
    no target in the batch adds 0. teacher (K, N, V): probabilities to use as soft targets (the
    cross-entropy against them) at the positions `targets` marks valid. head_weights: a factor per
    head on its CE (distill.accel.count_weights, for several processes).

    One cross-entropy over all K*N rows rather than one per head: indexing logits[i] per head made
    autograd build and sum K zero-filled (K, N, V) gradients, a third of a training step on the CPU.
    """
    K, N, V = logits.shape
    t = targets.T.reshape(K * N)  # (K*N,), head-major like logits
    valid = t != IGNORE
    logp = logits.reshape(K * N, V).float().log_softmax(-1)  # (K*N, V)
    if teacher is None:
        ce = -logp.gather(1, t.clamp(min=0)[:, None])[:, 0]  # (K*N,)
    else:
        ce = -(teacher.reshape(K * N, V) * logp).sum(-1)
    ce = torch.where(valid, ce, torch.zeros_like(ce)).view(K, N)
    per_head = ce.sum(1) / valid.view(K, N).sum(1).clamp(min=1)  # (K,)
    weights = decay ** torch.arange(K, dtype=torch.float32, device=logits.device)
    if head_weights is not None:
        weights = weights * torch.tensor(head_weights, dtype=torch.float32, device=logits.device)
    return (weights * per_head).sum(), per_head.detach().tolist()


@torch.no_grad()
def head_accuracy(heads: MedusaHeads, hidden: torch.Tensor, targets: torch.Tensor, topk: int = 10,
                  batch_size: int = 512) -> list[list[float]]:
    """acc[i][r] = P(head i's rank-r guess equals its target) over the positions with a target."""
    K = heads.num_heads
    hits = torch.zeros(K, topk)
    counts = torch.zeros(K)
    device = next(heads.parameters()).device
    for lo in range(0, hidden.shape[0], batch_size):
        h = hidden[lo:lo + batch_size].to(device)
        t = targets[lo:lo + batch_size].to(device)  # (n, K)
        idx = heads.top_tokens(h, topk)  # (K, n, topk), among the heads' guess vocabulary
        for i in range(K):
            valid = t[:, i] != IGNORE
            hits[i] += (idx[i][valid] == t[valid, i, None]).float().sum(0).cpu()
            counts[i] += valid.sum().cpu()
    return (hits / counts.clamp(min=1)[:, None]).tolist()


def _noise(h: torch.Tensor, scale: float, generator: torch.Generator) -> torch.Tensor:
    """Gaussian noise like h (n, C), each row's standard deviation `scale` times that row's RMS."""
    rms = h.pow(2).mean(-1, keepdim=True).sqrt()  # (n, 1)
    return torch.randn(h.shape, generator=generator, device=h.device, dtype=h.dtype) * (scale * rms)


def _head_logits(heads: MedusaHeads, h: torch.Tensor, vocab: torch.Tensor | None) -> torch.Tensor:
    """The training forward: logits (K, n, V or V') of every head from hidden states h (n, C)."""
    return heads.head_logits(heads.features(h), vocab)


class MedusaTask(Task):
    """Medusa-1 for distill.trainer: steps over shuffled batches of cached positions, the summed
    head cross-entropy (`medusa_loss`), the heads' state dict as checkpoint/heads.safetensors."""

    desc = "training Medusa heads"
    loss_label = "sum_i 0.8^i CE_i"

    def __init__(self, heads: MedusaHeads, hidden: torch.Tensor, targets: torch.Tensor,
                 vocab: torch.Tensor | None, config: MedusaTrainConfig) -> None:
        self.heads, self.hidden, self.targets, self.vocab, self.config = heads, hidden, targets, vocab, config
        self.forward = Forward(heads, _head_logits)  # one module call: DDP syncs its gradients
        self.per_epoch = math.ceil(hidden.shape[0] / config.batch_size)
        self.total_steps = self.per_epoch * config.epochs

    def module(self) -> Forward:
        return self.forward

    def begin(self, run: Trainer) -> None:
        self.noise_gen = torch.Generator(run.acc.device).manual_seed(self.config.seed + run.step)  # drawn anew
        if self.vocab is not None:
            self.vocab = self.vocab.to(run.acc.device)
        run.model.train()

    def micro_batches(self, run: Trainer, step: int) -> list[int]:
        return [step]

    def loss(self, run: Trainer, step: int) -> torch.Tensor:
        cfg, acc = self.config, run.acc
        epoch, b = divmod(step, self.per_epoch)
        order = torch.randperm(self.hidden.shape[0], generator=torch.Generator().manual_seed(cfg.seed + epoch))
        idx = order[b * cfg.batch_size:(b + 1) * cfg.batch_size]  # the global batch
        h = self.hidden[idx].to(acc.device, torch.float32)  # (n, C)
        if cfg.feature_noise:  # drawn for the global batch: the same noise whatever the processes
            h = h + _noise(h, cfg.feature_noise, self.noise_gen)
        part, weight = local_part(idx.numel(), acc)  # this process's rows of the batch
        idx, h = idx[part], h[part]
        t = self.targets[idx].to(acc.device)
        teacher = None
        if cfg.soft_targets:
            with run.autocast():
                teacher = teacher_probs(self.heads, self.hidden, idx, self.vocab)  # (K, n, V')
        with run.autocast():
            logits = run.model(h, self.vocab)  # (K, n, V or V')
        # several processes: each head's CE weighted by this process's share of its valid rows
        counts = (t != IGNORE).sum(0).tolist() if weight else [0] * t.shape[1]
        return medusa_loss(logits, t, cfg.decay, teacher, count_weights(counts, acc))[0]

    def save_weights(self, directory: Path) -> None:
        state = {k: v.detach().cpu().contiguous() for k, v in self.heads.state_dict().items()}
        atomic_write(directory / "heads.safetensors", lambda tmp: save_file(state, tmp))

    def load_weights(self, directory: Path) -> None:
        self.heads.load_state_dict(load_file(str(directory / "heads.safetensors")))


def train_medusa(heads: MedusaHeads, data_dir: str | Path, out_dir: str | Path,
                 config: MedusaTrainConfig = MedusaTrainConfig(), deadline: float | None = None,
                 resume: bool = True) -> dict:
    """Train `heads` (from distill.attach_medusa) on the hidden states cached in `data_dir`.

    Writes to `out_dir`: the heads (distill.save_medusa; their tree built from the held-out
    accuracy), `checkpoint/` (resumed from when `resume`), `loss.png` and `metrics.json`.
    `out_dir` must be new, empty or a Medusa training directory (TRAIN_MARKERS), else OutputPathError;
    `data_dir` must be a cache of these heads' model, else ValueError: both are checked before `out_dir`
    is created, and a run that fails before its first checkpoint removes it again.
    deadline: a time.monotonic() value at which training stops early (evaluation still runs); the
    cosine decay then follows the time spent (distill.trainer.set_lr). Training starts from the
    heads' whole vocabulary; with vocab="data" the trained heads guess among the training answers'
    tokens only (`MedusaHeads.restrict_vocab`).
    Returns the metrics: per-head top-1 / top-k accuracy, the accuracy table, the tree, losses.
    """
    out_dir = check_train_dir(out_dir)
    K = heads.num_heads
    if _past(deadline) and not _cached_shards(data_dir, "train"):  # the deadline stopped the cache, not the data
        raise ValueError(f"{out_of_time('any training position was cached')} (the {MedusaLayout.what} {data_dir} holds "
                         "none yet)")
    hidden, targets = load_cached(data_dir, "train", K)  # the data is checked before `out_dir` is created
    hidden_ho, targets_ho = load_cached(data_dir, "heldout", K)
    _check_cache_fits(heads, data_dir, hidden, torch.cat([targets, targets_ho]))
    with created_output(out_dir):  # a run that fails before its first checkpoint leaves no new directory
        return _train(heads, hidden, targets, hidden_ho, targets_ho, out_dir, config, deadline, resume)


def _past(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() > deadline


def _cached_shards(data_dir: str | Path, split: str) -> int:
    """How many shards of `split` the manifest of `data_dir` lists (0 without a readable manifest)."""
    try:
        return len(json.loads((Path(data_dir) / MANIFEST).read_text())["shards"][split])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def _check_cache_fits(heads: MedusaHeads, data_dir: str | Path, hidden: torch.Tensor, targets: torch.Tensor) -> None:
    """ValueError unless the cached states have the heads' hidden size and the targets are token ids
    of the heads' vocabulary (a cache of another model)."""
    C, V = heads.config.hidden_size, heads.config.vocab_size
    ids = targets[targets != IGNORE]
    if hidden.shape[1] != C or (ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < V):
        raise ValueError(f"{data_dir} caches hidden size {hidden.shape[1]} and token ids up to "
                         f"{int(ids.max()) if ids.numel() else None}; these heads read hidden size {C} and score "
                         f"{V} tokens: the cache belongs to another model, use one built for this model")


def _train(heads: MedusaHeads, hidden: torch.Tensor, targets: torch.Tensor, hidden_ho: torch.Tensor,
           targets_ho: torch.Tensor, out_dir: Path, config: MedusaTrainConfig, deadline: float | None,
           resume: bool) -> dict:
    """`train_medusa` on loaded, checked data, into `out_dir` (which exists)."""
    heads.restrict_vocab(None)  # which tokens the heads guess among is decided by this training
    heads.requires_grad_(True)
    vocab = None
    if config.vocab == "data":  # softmax over the tokens the answers use: a fraction of the cost
        vocab = data_vocab(targets, config.max_vocab)  # (V',)
        remap = torch.full((heads.config.vocab_size,), IGNORE, dtype=torch.long)
        remap[vocab] = torch.arange(vocab.numel())
        targets = torch.where(targets == IGNORE, targets, remap[targets.clamp(min=0)])
    task = MedusaTask(heads, hidden, targets, vocab, config)
    run = Trainer(task, config, out_dir, CheckpointDir(out_dir / "checkpoint")).fit(deadline, resume)
    heads.eval().requires_grad_(False)
    if task.vocab is not None:  # the heads learned to rank these tokens only: they guess among them
        heads.restrict_vocab(task.vocab)
    table = head_accuracy(heads, hidden_ho, targets_ho, config.topk)
    paths = choose_tree(heads, table, config.tree_nodes)
    if run.acc.is_main_process:
        save_medusa(heads, out_dir, overwrite=True)  # this job's own heads (a resumed run saves them again)
    return run.report({
        "train_positions": int(hidden.shape[0]), "heldout_positions": int(hidden_ho.shape[0]),
        "top1_accuracy": [r[0] for r in table],
        f"top{config.topk}_accuracy": [sum(r) for r in table],
        "accuracy_by_rank": table, "tree": [list(p) for p in paths],
        "expected_accepted_per_step": expected_length(paths, table),
        "train_vocab": int(vocab.numel()) if vocab is not None else heads.config.vocab_size,
    })
