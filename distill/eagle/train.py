"""EAGLE-3 training (Li et al. 2025): one head on a frozen target, with training-time test.

1. Features: `distill.data.features.cache_eagle_states` runs the target once over the
   self-distillation records (its own answers, distill.data.selfdistill) and caches, per record, the
   states entering its three aux layers at every position and the final-norm states at the answer
   positions (resumable, like the Medusa cache). Training may read several caches at once (e.g.
   ShareGPT's own answers read teacher-forced, distill.data.dataset_answers); the first one's
   held-out split measures the head.
2. Draft vocabulary: the `draft_vocab_size` most frequent answer tokens of the (first) training
   split (ties, and ids it never saw, by their count in the other caches' answers, then lower id
   first, filling up a vocabulary larger than what the answers use), set through
   `Eagle3Head.set_draft_vocab`. With `init_from_target` the head's `lm_head` starts as the
   target's LM head rows of those ids, as speculators initialises it (speculators then freezes
   them; trained here, since freezing measured worse on smollm2: docs/experiments/
   2026-11-25-eagle-smollm2-budget.md), and its `norm` as the target's final norm.
3. Training-time test (`unroll`): step 0 at position t reads fuse(aux[t - 1]) and the embedding of
   token t (the alignment of specdec.drafters.eagle.head); step s > 0 at the same row reads the head's own
   output of step s - 1 there (normed, with the default `norm_output` of Eagle 3.1; `fuse` norms
   each aux layer first with the default `fc_norm`), the embedding of token t + s at position
   t + s, and attends through
   one `UnrollCache` (step 0 causally, later steps their own position), so the head learns from
   inputs like those it drafts from.
4. Loss (`ttt_loss`): sum_s decay^s CE_s, where CE_s is the mean over the rows whose step-s
   prediction is an answer token (position t + s from the last prompt token to the last answer
   token but one) of -sum_v p_v log q_v: p = softmax(h W_d^T), the target's next-token
   distribution restricted to the draft vocabulary and renormalised (h the cached final-norm
   state at position t + s, W_d the target's LM head rows of the draft ids), q = softmax of the
   head's logits. Per-depth accuracy: argmax q == argmax p.
5. `train_eagle`: `distill.trainer`'s loop (`EagleTask`: AdamW, warm-up + cosine decay, gradient
   clipping, checkpoints in OUT/checkpoint, the head in the speculators format beside
   eagle_trainer.json, and resume), then held-out per-depth accuracy, OUT/loss.png,
   OUT/metrics.json and the head itself in OUT (specdec.load_eagle(OUT, target)).
"""

from __future__ import annotations

import copy
import json
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from distill.accel import Forward, count_weights, local_items
from distill.config_args import at_least
from distill.data.features import MANIFEST, EagleLayout, EagleSplit, cache_eagle_states, load_split, read_manifest
from distill.data.selfdistill import read_records
from distill.trainer import CheckpointDir, Panel, Task, Trainer, TrainerConfig, running_mean, trainer_field
from runtime.model_output import check_aux_layers
from runtime.output_paths import created_output, prepare_output_dir
from runtime.qlinear import QuantizedLinear
from specdec.drafters.eagle.head import Eagle3Config, Eagle3Head, UnrollCache, default_aux_layers
from specdec.drafters.eagle.io import read_eagle_config, write_eagle_files

CHECKPOINT = "checkpoint"
TRAINER = "eagle_trainer.json"
CACHE_DIR = "eagle_cache"
# files that mark an EAGLE-3 training directory (`specdec eagle train --out`, the recipes' OUT): one of
# them there and training resumes in it; a non-empty directory without them is refused
# features of ShareGPT's own answers in a training directory (`eagle train --dataset-answers`, the recipes)
ANSWERS_CACHE_DIR = "eagle_cache_answers"
TRAIN_MARKERS = (f"{CHECKPOINT}/{TRAINER}", f"{CACHE_DIR}/{MANIFEST}", f"{ANSWERS_CACHE_DIR}/{MANIFEST}",
                 "selfdistill.jsonl", "budget.json")
SAVE_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def check_train_dir(out_dir: str | Path) -> Path:
    """Fail (OutputPathError) unless `out_dir` is new, empty or an EAGLE-3 training directory."""
    return prepare_output_dir(out_dir, TRAIN_MARKERS, what="EAGLE-3 training directory", resume=True)


def _decay_check(value: float) -> None:
    if not 0 < value <= 1:
        raise ValueError(f"must be in (0, 1], got {value}")


def _aux_check(value: str) -> None:
    if value and not re.fullmatch(r"\s*\d+\s*,\s*\d+\s*,\s*\d+\s*", value):
        raise ValueError(f"must be three comma-separated layer ids such as 2,14,25 (empty: 2, L // 2, L - 3), "
                         f"got {value!r}")


@dataclass(frozen=True)
class EagleTrainConfig(TrainerConfig):
    """EAGLE-3 training hyper-parameters: the one declaration of their defaults (the shared ones,
    lr to seed, are distill.trainer.TrainerConfig's).

    `specdec eagle train` and the EAGLE recipes derive their flags from these fields
    (`distill.config_args`); each field's `help` is the flag's help text. ttt_steps 3, decay 0.8,
    gradient clipping 0.5 and the 32k draft vocabulary follow EAGLE-3 / speculators; lr and
    batch_tokens are starting points for a CPU budget, not tuned values.
    """

    lr: float = trainer_field("lr", 5e-4)
    max_grad_norm: float | None = trainer_field("max_grad_norm", 0.5)
    ttt_steps: int = field(default=3, metadata={
        "help": "training-time test: unrolled steps per position; step s > 0 reads the head's own output of step "
                "s - 1 and predicts s tokens further", "check": at_least(1)})
    draft_vocab_size: int = field(default=32768, metadata={
        "help": "tokens the head scores: the most frequent of the target's own answers (capped at the target's "
                "vocabulary)", "check": at_least(1)})
    aux_layers: str = field(default="", metadata={
        "help": "the three target layers whose input states the head reads, e.g. 2,14,25 (empty: 2, L // 2, L - 3)",
        "check": _aux_check})
    norm_before_residual: bool = field(default=False, metadata={
        "help": "the decoder layer's residual is the normed fused state instead of the fused state"})
    norm_before_fc: bool = field(default=False, metadata={
        "help": "RMSNorm the concatenated aux states as one vector before fc (speculators' default for eagle3; "
                "needs --no-fc-norm)"})
    fc_norm: bool = field(default=True, metadata={
        "help": "RMSNorm each aux layer's states on its own before fc (Eagle 3.1; the best of the three on "
                "smollm2: docs/experiments/2026-11-26-eagle-norms.md)"})
    norm_output: bool = field(default=True, metadata={
        "help": "the next unrolled step reads the head's output after its final norm (Eagle 3.1; off: the "
                "original EAGLE-3)"})
    init_from_target: bool = field(default=True, metadata={
        "help": "start the head's LM head from the target's rows of the draft ids and its norm from the "
                "target's final norm"})
    epochs: int = field(default=4, metadata={"help": "passes over the cached training records", "check": at_least(1)})
    batch_tokens: int = field(default=2048, metadata={
        "help": "padded tokens (rows x longest record) per training step; a longer record is a step alone",
        "check": at_least(1)})
    decay: float = field(default=0.8, metadata={"help": "loss weight of unrolled step s is decay**s",
                                                "check": _decay_check})
    heldout_every: int = field(default=20, metadata={
        "help": "every N-th record is held out of training and measures per-depth accuracy (fixed per cache)",
        "check": at_least(2)})
    save_dtype: str = field(default="bfloat16", metadata={"help": "dtype of the saved head (checkpoints: float32)",
                                                          "choices": tuple(SAVE_DTYPES)})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("EagleTrainConfig: norm_before_fc and fc_norm exclude each other (one norm over the "
                             "concatenated aux states, or one per layer; fc_norm is the default): add --no-fc-norm")

    def layers(self, num_layers: int) -> tuple[int, int, int]:
        """The aux layers for a target of `num_layers` layers (the default when `aux_layers` is empty)."""
        if not self.aux_layers:
            return default_aux_layers(num_layers)
        return tuple(int(x) for x in self.aux_layers.split(","))


def answer_vocab(answer_tokens: torch.Tensor, vocab_size: int, size: int,
                 fill_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """The `size` most frequent ids of `answer_tokens` (M,), sorted; ties and unseen ids by their
    count in `fill_tokens` (other answers: they fill what the first ones leave), then by lower id."""
    counts = torch.bincount(answer_tokens.flatten(), minlength=vocab_size)[:vocab_size]  # (V,)
    if fill_tokens is not None and fill_tokens.numel():
        fill = torch.bincount(fill_tokens.flatten(), minlength=vocab_size)[:vocab_size]  # (V,)
        counts = counts * (int(fill.max()) + 1) + fill  # the first count decides, the fill count breaks ties
    order = torch.sort(counts, descending=True, stable=True).indices
    return order[:size].sort().values


def lm_head_rows(target, token_ids: torch.Tensor) -> torch.Tensor:
    """The target's LM head rows of `token_ids` (Vd,) as float32 (Vd, C) (quantized heads dequantized)."""
    head = target.lm_head
    weight = head.dequantize(torch.float32) if isinstance(head, QuantizedLinear) else head.weight.detach()
    return weight[token_ids.to(weight.device)].float()


def soft_targets(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The target's next-token distribution over the draft vocabulary, renormalised: softmax of its
    logits at the draft ids, (n, Vd), from final-norm states (n, C) and LM head rows (Vd, C)."""
    return (hidden.float() @ weight.float().T).softmax(-1)


def ttt_loss(logits: list[torch.Tensor], teacher: list[torch.Tensor], decay: float,
             step_weights: list[float] | None = None) -> tuple[torch.Tensor, list[float | None], list[float | None]]:
    """sum_s decay^s CE(teacher[s], logits[s]) for per-step logits and soft targets (n_s, Vd), each
    CE the mean over its rows of -sum_v p_v log q_v. Returns the loss, CE per step and the accuracy
    per step (argmax agreement); a step without rows adds 0 and reports None. step_weights: a
    factor per step on its CE (distill.accel.count_weights, for several processes)."""
    loss = logits[0].new_zeros((), dtype=torch.float32)
    ce, acc = [], []
    for s, (q, p) in enumerate(zip(logits, teacher)):
        if q.shape[0] == 0:
            ce.append(None)
            acc.append(None)
            continue
        ce_s = -(p * q.float().log_softmax(-1)).sum(-1).mean()
        loss = loss + decay ** s * (ce_s if step_weights is None else step_weights[s] * ce_s)
        ce.append(float(ce_s.detach()))
        acc.append(float((q.detach().argmax(-1) == p.argmax(-1)).float().mean()))
    return loss, ce, acc


@dataclass
class Batch:
    """Records padded for `unroll`; index i of the last three stands for position i + 1.

    aux (B, T, 3C): the aux states at positions 0..T-1 (T = longest record - 1); tokens (B, T + k);
    teacher (B, T + k, C): final-norm states where `valid` (B, T + k) marks a loss position."""

    aux: torch.Tensor
    tokens: torch.Tensor
    teacher: torch.Tensor
    valid: torch.Tensor


def make_batch(split: EagleSplit, ids: list[int], steps: int) -> Batch:
    """Records `ids` of `split`, right-padded, for `steps` unrolled steps."""
    recs = [split.record(i) for i in ids]
    T = max(r[2].numel() for r in recs) - 1
    B, C = len(recs), split.hidden.shape[1]
    aux = split.aux.new_zeros(B, T, 3 * C)  # (B, T, 3C)
    tokens = torch.zeros(B, T + steps, dtype=torch.long)  # (B, T + k)
    teacher = split.hidden.new_zeros(B, T + steps, C)  # (B, T + k, C)
    valid = torch.zeros(B, T + steps, dtype=torch.bool)  # (B, T + k)
    for b, (a, h, t, P) in enumerate(recs):
        L = t.numel()
        aux[b, :L - 1] = a[:L - 1]
        tokens[b, :L - 1] = t[1:]
        lo = P - 2  # the index of position P - 1, the first loss position (hidden row 0)
        rows = h[max(0, -lo):]  # position 0 has no step: it has no aux state before it
        lo = max(lo, 0)
        teacher[b, lo:L - 2] = rows
        valid[b, lo:L - 2] = True
    return Batch(aux, tokens, teacher, valid)


def unroll(head: Eagle3Head, embed, batch: Batch, steps: int) -> list[torch.Tensor]:
    """Training-time test over `batch`: `steps` head steps on one UnrollCache, step s > 0 reading the
    previous step's outputs. Returns per step the draft logits (n_s, Vd) at its loss positions."""
    device = head.device
    B, T, _ = batch.aux.shape
    hidden = head.fuse(batch.aux.to(device, head.dtype))  # (B, T, C)
    positions = torch.arange(1, T + 1, device=device)[None].expand(B, -1)  # (B, T)
    last = head.config.max_position_embeddings - 1
    cache, out = UnrollCache(), []
    for s in range(steps):
        with torch.no_grad():
            embeds = embed(batch.tokens[:, s:s + T].to(device)).to(head.dtype)  # (B, T, C)
        hidden = head.step(hidden, embeds, (positions + s).clamp(max=last), cache)  # (B, T, C)
        out.append(head.logits(hidden[batch.valid[:, s:s + T].to(device)]))  # (n_s, Vd)
    return out


def batch_teacher(batch: Batch, weight: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Per step the soft targets (n_s, Vd) at the loss positions `unroll` scores. Step s scores the
    positions of step 0 shifted by s, so each position's distribution is computed once and the
    steps gather their rows (the (n, C) x (C, Vd) product costs as much as the head's LM head)."""
    T = batch.aux.shape[1]
    probs = soft_targets(batch.teacher[batch.valid].to(weight.device), weight)  # (n, Vd)
    row = torch.full(batch.valid.shape, -1, dtype=torch.long)  # (B, T + k): row of probs, -1 = no loss
    row[batch.valid] = torch.arange(probs.shape[0])
    return [probs[row[:, s:s + T][batch.valid[:, s:s + T]].to(probs.device)] for s in range(steps)]


def group_records(order: list[int], lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Consecutive records of `order` grouped so that rows x (longest length - 1) <= batch_tokens."""
    batches, cur, longest = [], [], 0
    for i in order:
        n = lengths[i] - 1
        if cur and max(longest, n) * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    return batches + ([cur] if cur else [])


def epoch_batches(lengths: list[int], batch_tokens: int, seed: int, epoch: int, window: int = 32) -> list[list[int]]:
    """One epoch's batches: records shuffled by a generator seeded with seed + epoch, then sorted by
    length within windows of `window` records (less padding), then grouped."""
    order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    order = [i for lo in range(0, len(order), window) for i in sorted(order[lo:lo + window], key=lengths.__getitem__)]
    return group_records(order, lengths, batch_tokens)


@torch.no_grad()
def evaluate(head: Eagle3Head, embed, split: EagleSplit, weight: torch.Tensor, steps: int, decay: float,
             batch_tokens: int = 2048) -> dict:
    """Held-out CE and accuracy per unrolled step (position-weighted means) and the weighted loss."""
    ce_sum, hits, count = torch.zeros(steps), torch.zeros(steps), torch.zeros(steps)
    lengths = split.lengths.tolist()
    for ids in group_records(sorted(range(len(lengths)), key=lengths.__getitem__), lengths, batch_tokens):
        batch = make_batch(split, ids, steps)
        for s, (q, p) in enumerate(zip(unroll(head, embed, batch, steps), batch_teacher(batch, weight, steps))):
            ce_sum[s] += float(-(p * q.float().log_softmax(-1)).sum())
            hits[s] += float((q.argmax(-1) == p.argmax(-1)).sum())
            count[s] += q.shape[0]
    ce = (ce_sum / count.clamp(min=1)).tolist()
    return {"loss": sum(decay ** s * c for s, c in enumerate(ce)), "ce_per_step": ce,
            "accuracy_per_step": (hits / count.clamp(min=1)).tolist(), "positions_per_step": count.long().tolist()}


def _differences(saved: Eagle3Config, wanted: Eagle3Config) -> str:
    """ "name (checkpoint X, asked Y)" for every field in which two head configs differ."""
    old, new = saved.to_dict(), wanted.to_dict()
    return ", ".join(f"{k} (checkpoint {old[k]!r}, asked {new[k]!r})" for k in new if old[k] != new[k])


def _training_data(target, data, layers: tuple[int, ...]) -> list[Path] | list[dict]:
    """What `train_eagle` trains on, checked before anything is created: the feature caches `data`
    names (one directory or a list of them, each read by the target's hidden size and `layers`), or
    the self-distillation records it holds (a jsonl path or a list of {"id", "prompt_ids",
    "output_ids"}: at least one, token ids of the target's vocabulary). ValueError / TypeError."""
    if isinstance(data, (list, tuple)) and data and all(isinstance(d, (str, Path)) for d in data):
        missing = [str(d) for d in data if not (Path(d) / MANIFEST).is_file()]
        if missing:
            raise ValueError(f"not EAGLE-3 feature caches (no {MANIFEST}): {missing}")
        dirs = [Path(d) for d in data]
    elif isinstance(data, (str, Path)) and (Path(data) / MANIFEST).is_file():
        dirs = [Path(data)]
    elif isinstance(data, (str, Path, list, tuple)):
        records = read_records(data) if isinstance(data, (str, Path)) else list(data)
        if not records:
            raise ValueError(f"no self-distillation records in {data if isinstance(data, (str, Path)) else 'data'}; "
                             "run `specdec eagle data` first")
        _check_records(records, target.config.vocab_size)
        return records
    else:
        raise TypeError(f"data must be a feature cache directory, a list of them, a self-distillation jsonl path or "
                        f"a list of records, got {type(data).__name__}")
    for d in dirs:
        manifest = read_manifest(d, EagleLayout)
        if tuple(manifest["aux_layers"]) != layers or manifest["hidden_size"] != target.config.hidden_size:
            raise ValueError(f"{d} caches aux layers {manifest['aux_layers']} of hidden size "
                             f"{manifest['hidden_size']}; this head reads layers {list(layers)} of hidden size "
                             f"{target.config.hidden_size}: use another cache")
    return dirs


def _check_records(records: list, vocab_size: int) -> None:
    """TypeError / ValueError unless every record has token lists "prompt_ids" and "output_ids" of
    ids in [0, vocab_size)."""
    for i, r in enumerate(records):
        if not (isinstance(r, dict) and all(isinstance(r.get(k), list) for k in ("prompt_ids", "output_ids"))):
            raise TypeError(f"data record {i} must be a dict with the token lists 'prompt_ids' and 'output_ids' "
                            f"(distill.data.selfdistill's records), got {type(r).__name__}")
        ids = r["prompt_ids"] + r["output_ids"]
        if not all(isinstance(t, int) for t in ids) or (ids and not 0 <= min(ids) <= max(ids) < vocab_size):
            raise ValueError(f"data record {i} (id {r.get('id')!r}) holds tokens that are not ids of the target's "
                             f"vocabulary [0, {vocab_size}): records of another model?")


def _feature_dirs(target, data: list[Path] | list[dict], config: EagleTrainConfig, out_dir: Path | None,
                  scratch: Path, deadline: float | None) -> list[Path]:
    """The feature caches to train on: `data` itself when it is caches (`_training_data`), else its
    records cached into OUT/eagle_cache (or `scratch` without OUT)."""
    if isinstance(data[0], Path):
        return data
    cache = (out_dir if out_dir is not None else scratch) / CACHE_DIR
    return [cache_eagle_states(target, data, cache, config.layers(target.config.num_layers),
                               heldout_every=config.heldout_every, deadline=deadline)]


class EagleTask(Task):
    """EAGLE-3 for distill.trainer: steps over length-grouped batches of cached records, the
    training-time-test loss (`unroll`, `ttt_loss`), the head in the speculators format as checkpoint
    (checked against the configured head on resume), and the per-depth training accuracy per step."""

    desc = "training EAGLE-3 head"
    loss_label = "sum_s 0.8^s CE_s"

    def __init__(self, head: Eagle3Head, target, train: EagleSplit, weight: torch.Tensor,
                 config: EagleTrainConfig) -> None:
        self.head, self.target, self.train, self.config = head, target, train, config
        self.weight = weight  # (Vd, C): the teacher's LM head rows of the draft ids
        self.forward = Forward(head, unroll)  # one module call: DDP syncs its gradients
        lengths = train.lengths.tolist()
        self.schedule = [b for e in range(config.epochs)
                         for b in epoch_batches(lengths, config.batch_tokens, config.seed, e)]
        self.total_steps = len(self.schedule)
        self.accuracy: list[list[float | None]] = []  # per step: the training accuracy per depth
        self.hits: list[float | None] = []

    def module(self) -> Forward:
        return self.forward

    def begin(self, run: Trainer) -> None:
        self.weight = self.weight.to(run.acc.device)
        run.model.train()

    def micro_batches(self, run: Trainer, step: int) -> list[int]:
        return [step]

    def loss(self, run: Trainer, step: int) -> torch.Tensor:
        k = self.config.ttt_steps
        ids, share = local_items(self.schedule[step], run.acc)  # this process's records of the global batch
        batch = make_batch(self.train, ids, k)
        with run.autocast():
            logits = run.model(self.target.embed, batch, k)
        with torch.no_grad():
            teacher = batch_teacher(batch, self.weight, k)
        # several processes: each step's CE weighted by this process's share of that step's rows
        weights = count_weights([q.shape[0] if share else 0 for q in logits], run.acc)
        loss, _, self.hits = ttt_loss(logits, teacher, self.config.decay, weights)
        return loss

    def end_step(self, run: Trainer) -> None:
        self.accuracy.append(self.hits)

    def save_weights(self, directory: Path) -> None:
        write_eagle_files(self.head, directory)  # the trainer's fresh checkpoint directory

    def load_weights(self, directory: Path) -> None:
        saved = read_eagle_config(directory, self.target)
        if saved != self.head.config:
            raise ValueError(f"{directory} holds a head that differs from what this configuration asks for in "
                             f"{_differences(saved, self.head.config)}; resume with the checkpoint's settings "
                             "(its norms were off by default before: --no-fc-norm --no-norm-output) or use "
                             "another output directory")
        self.head.load_state_dict(load_file(str(directory / "model.safetensors")))  # its draft vocabulary included

    def state(self) -> dict:
        return {"accuracy": self.accuracy}

    def load_state(self, state: dict) -> None:
        self.accuracy = state["accuracy"]


def train_eagle(target, data, config: EagleTrainConfig = EagleTrainConfig(), out_dir: str | Path | None = None, *,
                deadline: float | None = None, resume: bool = True) -> Eagle3Head:
    """Train an EAGLE-3 head for runtime model `target` (frozen) and return it (float32, eval mode).

    data: a feature cache directory (distill.data.features), a list of them, or self-distillation
    records (a jsonl path or a list of {"id", "prompt_ids", "output_ids"}) that are cached first
    into OUT/eagle_cache (a temporary directory without `out_dir`). With several caches, training
    reads every cache's train split and the held-out accuracy is measured on the first cache's
    held-out split (put the target's own answers first: the text the head drafts against; the
    others' held-out records are not read: cache them with heldout_every=0, as the recipes do).
    out_dir: new, empty or an EAGLE-3 training directory (TRAIN_MARKERS; else OutputPathError); it
    receives the checkpoints (resumed from when `resume`), the head (specdec.load_eagle(out_dir,
    target)), loss.png and metrics.json. Without it nothing is saved. `data`, the aux layers and
    `out_dir` are checked before `out_dir` is created (ValueError / TypeError / OutputPathError), and
    a run that fails before it cached or checkpointed anything removes a new `out_dir` again.
    deadline: a time.monotonic() value at which caching and training stop early (held-out
    evaluation and saving still run); see distill.trainer.Trainer.fit.
    """
    if out_dir is not None:
        out_dir = check_train_dir(out_dir)
    layers = check_aux_layers(config.layers(target.config.num_layers), target.config.num_layers)
    data = _training_data(target, data, layers)
    if out_dir is None:
        return _train(target, data, config, None, layers, deadline, resume)
    # a run that fails before a result (a checkpoint, cached features) leaves no new directory; an empty
    # cache (the deadline came before its first record) is no result
    with created_output(out_dir, own=(f"{CACHE_DIR}/{MANIFEST}",)):
        return _train(target, data, config, out_dir, layers, deadline, resume)


def _train(target, data: list[Path] | list[dict], config: EagleTrainConfig, out_dir: Path | None,
           layers: tuple[int, int, int], deadline: float | None, resume: bool) -> Eagle3Head:
    """`train_eagle` on checked data (`_training_data`), into `out_dir` (which exists) or nowhere."""
    from accelerate import PartialState  # heavy (accelerate): loaded when training starts, not at CLI start

    state = PartialState(cpu=target.device.type == "cpu")  # as the Accelerator below will ask
    with tempfile.TemporaryDirectory(prefix="eagle-features-") as scratch, state.main_process_first():
        # several processes: the main one fills OUT/eagle_cache, the others then only read it
        # (each fills its own scratch cache when there is no OUT)
        reader = not state.is_main_process and out_dir is not None
        data_dirs = _feature_dirs(target, data, config, out_dir, Path(scratch),
                                  time.monotonic() if reader else deadline)
        manifests = [read_manifest(d, EagleLayout) for d in data_dirs]
        # an extra cache a deadline stopped before its first shard adds nothing (the first one must hold records)
        splits = [load_split(d, "train") for i, (d, m) in enumerate(zip(data_dirs, manifests))
                  if i == 0 or m["shards"]["train"]]
        train = EagleSplit.concat(splits)
        heldout = load_split(data_dirs[0], "heldout") if manifests[0]["shards"]["heldout"] else None

    V, device, k = target.config.vocab_size, target.device, config.ttt_steps
    with torch.random.fork_rng(devices=[]):  # the head's initialisation, without touching the global RNG
        torch.manual_seed(config.seed)
        head = Eagle3Head(Eagle3Config.from_target(
            target, draft_vocab_size=min(config.draft_vocab_size, V), aux_layers=layers,
            norm_before_residual=config.norm_before_residual, norm_before_fc=config.norm_before_fc,
            fc_norm=config.fc_norm, norm_output=config.norm_output)).to(device)
    # the first cache's answers (the target's own) rank the draft vocabulary; the others fill it up
    extra = [s.answer_tokens() for s in splits[1:]]
    head.set_draft_vocab(answer_vocab(splits[0].answer_tokens(), V, head.config.draft_vocab_size,
                                      torch.cat(extra) if extra else None))
    if config.init_from_target:
        with torch.no_grad():
            head.lm_head.weight.copy_(lm_head_rows(target, head.target_ids(torch.arange(head.config.draft_vocab_size))))
            head.norm.weight.copy_(target.norm.weight.float())
    head.train().requires_grad_(True)
    draft_ids = head.target_ids(torch.arange(head.config.draft_vocab_size, device=head.d2t.device))
    task = EagleTask(head, target, train, lm_head_rows(target, draft_ids), config)
    ckpt = CheckpointDir(out_dir / CHECKPOINT, TRAINER) if out_dir is not None else None
    run = Trainer(task, config, out_dir, ckpt).fit(deadline, resume)
    head.eval().requires_grad_(False)
    if out_dir is None:
        run.acc.wait_for_everyone()
        return head
    held = None
    if run.acc.is_main_process:  # only the main process evaluates and writes
        if heldout:
            held = evaluate(head, target.embed, heldout, task.weight, k, config.decay, config.batch_tokens)
        # into the training directory check_train_dir accepted (beside its checkpoints and reports)
        write_eagle_files(copy.deepcopy(head).to(SAVE_DTYPES[config.save_dtype]), out_dir, speculative_tokens=k)
    vocab = torch.zeros(V, dtype=torch.bool)
    vocab[draft_ids.cpu()] = True
    recent = task.accuracy[-50:]
    run.report({
        "train_records": len(train), "train_positions": train.num_positions,
        "heldout_positions": heldout.num_positions if heldout else 0,
        "draft_vocab_size": head.config.draft_vocab_size, "aux_layers": list(layers),
        "draft_vocab_coverage": {"train": float(vocab[train.answer_tokens()].float().mean()),
                                 "heldout": float(vocab[heldout.answer_tokens()].float().mean()) if heldout else None},
        "train_accuracy_per_step": [_mean([a[s] for a in recent]) for s in range(k)],
        "heldout": held,
    }, [Panel("per-depth accuracy (training)", "argmax agreement with the target",
              [(*running_mean([a[s] for a in task.accuracy]), f"depth {s}") for s in range(k)])])
    return head


def _mean(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return sum(kept) / len(kept) if kept else None


def read_metrics(out_dir: str | Path) -> dict:
    """The metrics.json a finished `train_eagle` wrote to `out_dir`."""
    return json.loads((Path(out_dir) / "metrics.json").read_text())
