"""DistillSpec draft distillation (Zhou et al. 2023): train a draft model toward its target.

Each step (`distill_draft`):
1. rows: `batch_size` prompts per process and micro-step, in an order shuffled per epoch by a
   generator seeded with `seed` + epoch; answers from `distill.draft.onpolicy` (the draft's own samples
   by default, the target's answers, or a GKD-style mix), sampled with a torch.Generator seeded
   by (seed, step, micro-step, process), so a resumed run draws the same data;
2. the target scores the answer positions once under no_grad (logits only there:
   `logits_idx`), the draft scores them with gradients, and `distill.divergence` (fkl, rkl, jsd,
   tvd at `temperature`) averaged over the answer tokens is the loss;
3. AdamW on every trainable weight of the draft (full fine-tuning; `freeze_embeddings` keeps the
   embedding, and a tied LM head with it, fixed) or on LoRA adapters (`lora`, via peft; merged
   into the weights before saving), in `distill.trainer`'s loop (`DraftTask`: warm-up + cosine
   decay, gradient clipping, autocast of the draft's forward, `grad_accum` micro-steps per step).
   The same loop runs under `accelerate launch --num_processes N` (DDP: each process its own
   rows; each process's loss is weighted by its share of the step's answer tokens, so the
   averaged gradient and the logged loss are those of the mean over all of them).

Every `eval_every` steps the main process measures held-out acceptance: the draft's top-1
agreement with the target's greedy answers to the held-out prompts, teacher-forced
(`distill.draft.heldout`: the per-token acceptance probability of greedy speculative decoding, without
sampling noise; the answers are generated once and kept in OUT/heldout_answers.json), and, with
`eval_decode`, greedy speculative decoding of the target with the draft (a copy in the target's
dtype) on those prompts (`specdec.generate`; tau and the acceptance rate of its AcceptanceStats).
OUT receives checkpoints every `checkpoint_every` steps (OUT/distill_checkpoint/step-N:
trainable.safetensors, optimizer.pt, trainer.json; `latest.json` names the newest:
distill.trainer.StepCheckpoints), the distilled draft as a Hugging Face checkpoint
(model.safetensors + config.json + tokenizer: `runtime.load_model(OUT)`, `specdec eval --methods
draft:OUT`, `quant` compresses it), distill_metrics.json and distill.png (loss and held-out
acceptance over the steps).
"""

from __future__ import annotations

import copy
import functools
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import specdec
from distill.config_args import at_least, positive
from distill.data.code_prompts import STUB_CACHE
from distill.divergence import DIVERGENCES, masked_divergence
from distill.draft.heldout import HeldoutSet, agreement, target_answers
from distill.draft.onpolicy import DATA_SOURCES, batch_source, make_batch, sample_answers
from distill.trainer import Panel, StepCheckpoints, Task, Trainer, TrainerConfig, series, trainer_field
from runtime.atomic import atomic_write, atomic_write_text
from runtime.hf_state import dense_hf_state
from runtime.output_paths import created_output, prepare_output_dir

CHECKPOINTS = "distill_checkpoint"
HELDOUT_ANSWERS = "heldout_answers.json"
LATEST = StepCheckpoints.LATEST
METRICS = "distill_metrics.json"
# files that mark a draft distillation directory: with one of them there, distill_draft resumes in it
# (`specdec distill draft` caches the function stubs there before training starts)
TRAIN_MARKERS = (f"{CHECKPOINTS}/{LATEST}", METRICS, "budget.json", HELDOUT_ANSWERS, STUB_CACHE)
SAVE_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
LORA_TARGETS = ("wqkv", "wo", "w13", "w2")  # the runtime Transformer's linear layers


def _unit(value: float) -> None:
    if not 0 <= value <= 1:
        raise ValueError(f"must be in [0, 1], got {value}")


@dataclass(frozen=True)
class DistillConfig(TrainerConfig):
    """Draft distillation settings: the one declaration of their defaults (`specdec distill draft`
    and recipes/distill_qwen05_draft.py derive their flags from these fields; the shared ones, lr to
    seed, are distill.trainer.TrainerConfig's).

    Defaults: on-policy data and forward KL at temperature 1 (DistillSpec's greedy-decoding
    setting); full fine-tuning, because LoRA was not measured to give more held-out acceptance per
    CPU-minute (see docs/distillation.md); lr and batch are starting points for a CPU budget.
    """

    lr: float = trainer_field("lr", 1e-5)
    warmup_steps: int = trainer_field("warmup_steps", 10)
    max_grad_norm: float | None = trainer_field("max_grad_norm", 1.0)
    checkpoint_every: int = trainer_field("checkpoint_every", 25)

    data: str = field(default="on-policy", metadata={
        "help": "whose answers the draft learns on: on-policy (its own samples), target (the target's "
                "answers) or mixed (on-policy with probability --mixed-lambda per batch)", "choices": DATA_SOURCES})
    mixed_lambda: float = field(default=0.5, metadata={
        "help": "mixed data: probability that a batch is on-policy (GKD's lambda)", "check": _unit})
    divergence: str = field(default="fkl", metadata={
        "help": "per-token divergence over the vocabulary: fkl KL(p||q), rkl KL(q||p), jsd generalized JSD(beta), "
                "tvd total variation (1 - acceptance)", "choices": DIVERGENCES})
    beta: float = field(default=0.5, metadata={"help": "jsd: the teacher's weight in the mixture (0 = fkl, 1 = rkl)",
                                               "check": _unit})
    temperature: float = field(default=1.0, metadata={
        "help": "distillation temperature: both distributions are softmax(logits / T)", "check": positive})
    sample_temperature: float = field(default=1.0, metadata={
        "help": "temperature of the draft's on-policy samples (0 = greedy)", "check": at_least(0)})
    target_temperature: float = field(default=0.0, metadata={
        "help": "temperature of the target's answers for target / mixed data (0 = greedy)", "check": at_least(0)})
    max_new_tokens: int = field(default=128, metadata={"help": "answer length cap per row", "check": at_least(1)})
    batch_size: int = field(default=4, metadata={"help": "rows per process and micro-step", "check": at_least(1)})
    grad_accum: int = field(default=1, metadata={"help": "micro-steps per optimizer step", "check": at_least(1)})
    steps: int = field(default=300, metadata={"help": "optimizer steps planned (the schedule's length)",
                                              "check": at_least(1)})
    freeze_embeddings: bool = field(default=False, metadata={
        "help": "keep the token embedding fixed (and a tied LM head with it)"})
    lora: bool = field(default=False, metadata={
        "help": "train LoRA adapters on the attention and MLP linears (peft) instead of every weight; merged "
                "into the weights before saving"})
    lora_rank: int = field(default=16, metadata={"help": "LoRA rank", "check": at_least(1)})
    lora_alpha: float = field(default=32.0, metadata={"help": "LoRA alpha (scale alpha / rank)", "check": positive})
    eval_every: int = field(default=25, metadata={"help": "steps between held-out acceptance measurements",
                                                  "check": at_least(1)})
    eval_tokens: int = field(default=64, metadata={
        "help": "length cap of the target's held-out answers (teacher-forced agreement) and new tokens per held-out "
                "prompt when decoding", "check": at_least(1)})
    eval_decode: bool = field(default=True, metadata={
        "help": "also measure held-out tau by greedy speculative decoding of the held-out prompts (slower and "
                "noisier than the teacher-forced agreement, which is always measured)"})
    eval_draft_tokens: int = field(default=5, metadata={"help": "drafts per step when measuring acceptance",
                                                        "check": at_least(1)})
    save_dtype: str = field(default="bfloat16", metadata={"help": "dtype of the saved draft",
                                                          "choices": tuple(SAVE_DTYPES)})


def check_distill_dir(out_dir: str | Path) -> Path:
    """Fail (OutputPathError) unless `out_dir` is new, empty or a draft distillation directory."""
    return prepare_output_dir(out_dir, TRAIN_MARKERS, what="draft distillation directory", resume=True)


def _prompt_ids(prompts, vocab_size: int, what: str = "prompts") -> list[list[int]]:
    """Prompt token lists from lists of ids, 1-D tensors or (id, ids) pairs (distill.data.selfdistill's);
    ValueError for an empty prompt or a token id outside [0, vocab_size), naming `what`."""
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, tuple) and len(p) == 2 and not isinstance(p[1], int):
            p = p[1]
        ids = [int(t) for t in (p.tolist() if isinstance(p, torch.Tensor) else list(p))]
        if not ids:
            raise ValueError(f"{what}[{i}] is empty: every prompt needs at least one token")
        if not 0 <= min(ids) <= max(ids) < vocab_size:
            raise ValueError(f"{what}[{i}] holds token id {min(ids) if min(ids) < 0 else max(ids)}, outside the "
                             f"models' vocabulary [0, {vocab_size}): prompts tokenized for another model?")
        out.append(ids)
    return out


def _rows(order_for, n: int, start: int, count: int) -> list[int]:
    """Prompt indices of global rows start .. start + count - 1 (epoch e = row // n, shuffled per epoch)."""
    return [order_for(r // n)[r % n] for r in range(start, start + count)]


def _seed(*parts: int) -> int:
    value = 0
    for p in parts:
        value = (value * 1_000_003 + p) % (2 ** 63 - 1)
    return value


def _token_weight(tokens: int, acc) -> float:
    """tokens * processes / all processes' tokens: DDP's mean of the per-process gradients of the
    weighted mean losses is then the gradient of the mean over every answer token of the step."""
    if acc.num_processes == 1:
        return 1.0
    total = float(acc.reduce(torch.tensor([float(tokens)], device=acc.device), reduction="sum"))
    return tokens * acc.num_processes / max(total, 1.0)


def heldout_set(target, prompts: list[list[int]], config: DistillConfig, eos_token_id, out_dir: Path | None
                ) -> HeldoutSet:
    """The target's greedy answers to the held-out prompts: read from OUT/heldout_answers.json when it
    holds these prompts at this answer cap (`eval_tokens`), else generated (and written there)."""
    path = out_dir / HELDOUT_ANSWERS if out_dir is not None else None
    if path is not None and path.is_file():
        held = HeldoutSet.load(path)
        if held.prompts == prompts and held.max_new_tokens == config.eval_tokens:
            return held
    held = target_answers(target, prompts, config.eval_tokens, eos_token_id)
    if path is not None:
        held.save(path)
    return held


def heldout_acceptance(target, draft, prompts: list[list[int]], config: DistillConfig,
                       eos_token_id: int | list[int] | None = None) -> dict:
    """Greedy speculative decoding of `target` with `draft` on `prompts`: tau (tokens per target
    forward) and the acceptance rate, from specdec's AcceptanceStats."""
    rows = [torch.tensor(p, dtype=torch.long) for p in prompts]
    stats = specdec.generate(target, rows, draft=draft, max_new_tokens=config.eval_tokens, temperature=0.0,
                             num_draft_tokens=config.eval_draft_tokens, eos_token_id=eos_token_id).stats
    return {"tau": stats.mean_accepted_tokens, "acceptance_rate": stats.acceptance_rate}


def _add_lora(model, config: DistillConfig):
    """peft LoRA adapters on the draft's linears (only they train); returns the model."""
    from peft import LoraConfig, inject_adapter_in_model  # optional dependency: only LoRA distillation needs it

    with torch.random.fork_rng(devices=[]):  # the adapters' initialisation, without touching the global RNG
        torch.manual_seed(config.seed)
        lora = LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha, lora_dropout=0.0,
                          target_modules=list(LORA_TARGETS))
        return inject_adapter_in_model(lora, model)


def merge_lora(model) -> torch.nn.Module:
    """Fold every peft LoRA adapter of `model` into its base linear and put the linear back, in place."""
    from peft.tuners.tuners_utils import BaseTunerLayer  # optional dependency: only LoRA distillation needs it

    for name, module in list(model.named_modules()):
        if isinstance(module, BaseTunerLayer):
            module.merge()
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, module.get_base_layer())
    return model


def _trainable_state(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().to("cpu", torch.float32).contiguous() for n, p in model.named_parameters()
            if p.requires_grad}


def save_draft(model, out_dir: str | Path, tokenizer=None, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write runtime model `model` into `out_dir` as a Hugging Face checkpoint (model.safetensors,
    config.json, the tokenizer when given), each file atomically, the config last."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = dense_hf_state(model, dtype)
    hf_config = copy.deepcopy(model.config.hf_config)
    hf_config.tie_word_embeddings = "lm_head.weight" not in state
    hf_config.dtype = str(dtype).removeprefix("torch.")
    if tokenizer is not None:
        with tempfile.TemporaryDirectory(dir=out, prefix=".tokenizer.") as tmp:
            for f in tokenizer.save_pretrained(tmp):
                if Path(f).is_file():
                    Path(f).replace(out / Path(f).name)
    atomic_write(out / "model.safetensors", lambda tmp: save_file(state, tmp, metadata={"format": "pt"}))
    atomic_write_text(out / "config.json", hf_config.to_json_string())
    return out


class DraftTask(Task):
    """Draft distillation for distill.trainer: each micro-step samples its rows' answers
    (distill.draft.onpolicy), scores them with the target and the draft, and weighs the divergence by the
    process's share of the step's answer tokens; held-out acceptance every `eval_every` steps; the
    trainable weights as the checkpoint's trainable.safetensors."""

    desc = "distilling the draft"
    plot_file = "distill.png"
    metrics_file = METRICS
    final_window = 10

    def __init__(self, target, draft, train_prompts: list[list[int]], held: HeldoutSet | None,
                 held_prompts: list[list[int]], config: DistillConfig, eos_token_id, out_dir: Path | None) -> None:
        self.target, self.draft, self.prompts, self.config = target, draft, train_prompts, config
        self.held, self.held_prompts, self.eos_token_id, self.out_dir = held, held_prompts, eos_token_id, out_dir
        self.total_steps, self.eval_every = config.steps, config.eval_every
        self.loss_label = f"{config.divergence} per answer token"
        self.order_for = functools.lru_cache(maxsize=2)(self._order)

    def module(self):
        return self.draft

    def _order(self, epoch: int) -> list[int]:
        """The prompt order of `epoch`."""
        return torch.randperm(len(self.prompts),
                              generator=torch.Generator().manual_seed(_seed(self.config.seed, epoch))).tolist()

    def micro_batches(self, run: Trainer, step: int) -> list[tuple[int, int]]:
        return [(step, micro) for micro in range(self.config.grad_accum)]

    def loss(self, run: Trainer, micro: tuple[int, int]) -> torch.Tensor:
        cfg, acc, raw = self.config, run.acc, run.raw
        step, m = micro
        start = ((step * cfg.grad_accum + m) * cfg.batch_size * acc.num_processes
                 + acc.process_index * cfg.batch_size)
        rows = [self.prompts[i] for i in _rows(self.order_for, len(self.prompts), start, cfg.batch_size)]
        gen = torch.Generator(device=acc.device).manual_seed(_seed(cfg.seed, step, m, acc.process_index))
        source = batch_source(cfg.data, cfg.mixed_lambda, gen)
        raw.eval()
        answers = sample_answers(raw if source == "draft" else self.target, rows, cfg.max_new_tokens,
                                 cfg.sample_temperature if source == "draft" else cfg.target_temperature,
                                 gen, self.eos_token_id)
        raw.train()
        batch = make_batch(rows, answers).to(acc.device)
        with torch.no_grad():
            teacher = self.target(batch.tokens, batch.positions, None, logits_idx=batch.idx).logits  # (B, N, V)
        with run.autocast():
            student = run.model(batch.tokens, batch.positions, None, logits_idx=batch.idx).logits  # (B, N, V)
        loss = masked_divergence(student, teacher, batch.valid, cfg.divergence, cfg.temperature, cfg.beta)
        return loss * _token_weight(batch.answer_tokens, acc) / cfg.grad_accum

    def evaluate(self, run: Trainer) -> dict | None:
        if not self.held_prompts or not run.acc.is_main_process:
            return None
        if self.held is None:
            self.held = heldout_set(self.target, self.held_prompts, self.config, self.eos_token_id, self.out_dir)
        raw = run.raw.eval()
        record = agreement(raw, self.held, self.config.eval_draft_tokens, bf16=run.precision == "bf16")
        if self.config.eval_decode:
            # the draft as it will serve, in the target's dtype (a bf16 copy reads half the bytes of float32)
            probe = raw if raw.dtype == self.target.dtype else copy.deepcopy(raw).to(self.target.dtype)
            record.update(heldout_acceptance(self.target, probe.eval(), self.held_prompts, self.config,
                                             self.eos_token_id))
            del probe
        raw.train()
        return record

    def save_weights(self, directory: Path) -> None:
        state = {n: p.detach().to("cpu", torch.float32).contiguous() for n, p in self.draft.named_parameters()
                 if p.requires_grad}
        atomic_write(directory / "trainable.safetensors", lambda tmp: save_file(state, tmp))

    def load_weights(self, directory: Path) -> None:
        saved = load_file(str(directory / "trainable.safetensors"))
        params = dict(self.draft.named_parameters())
        if set(saved) != {n for n, p in params.items() if p.requires_grad}:
            raise ValueError(f"{directory} holds other trainable weights than this configuration trains (lora, "
                             "freeze_embeddings or the draft differ); use another output directory")
        with torch.no_grad():
            for n, t in saved.items():
                params[n].copy_(t)


def distill_draft(target, draft, prompts, config: DistillConfig = DistillConfig(), out_dir: str | Path | None = None,
                  *, heldout=None, tokenizer=None, eos_token_id: int | list[int] | None = None,
                  deadline: float | None = None, resume: bool = True, stop_after: int | None = None):
    """Distil runtime model `draft` toward runtime model `target` (frozen) and return the draft
    (trained in place; LoRA merged back; eval mode, no gradients).

    prompts: training prompts (lists of token ids, 1-D tensors, or (id, ids) pairs as
    distill.data.selfdistill.sharegpt_prompts returns). heldout: prompts for the held-out acceptance
    measurement (the target's greedy answers to them are generated at the first measurement), or a
    distill.draft.heldout.HeldoutSet that already holds those answers (None: not measured). The draft
    should be float32 (it trains in place under `config.mixed_precision`); draft and target must
    share the vocabulary. out_dir: new, empty or a draft distillation directory (TRAIN_MARKERS;
    else OutputPathError), resumed from when `resume`; it receives checkpoints, the draft (with
    `tokenizer`), heldout_answers.json, distill_metrics.json and distill.png; without it nothing is
    saved. The models, prompts and `out_dir` are checked before `out_dir` is created, and a run
    that fails before it wrote anything there removes a new `out_dir` again. deadline: a
    time.monotonic() value after which no step starts (the schedule decays toward it). stop_after:
    end this call after that many steps in all (the schedule still spans config.steps; the same
    call later resumes).
    """
    if target.config.vocab_size != draft.config.vocab_size:
        raise ValueError(f"the target scores {target.config.vocab_size} tokens and the draft "
                         f"{draft.config.vocab_size}: a draft must share its target's vocabulary")
    V = target.config.vocab_size
    train_prompts = _prompt_ids(prompts, V)
    if not train_prompts:
        raise ValueError("no training prompts; pass prompt token lists (e.g. distill.sharegpt_prompts(tok))")
    if isinstance(heldout, HeldoutSet):
        held, held_prompts = heldout, _prompt_ids(heldout.prompts, V, "heldout.prompts")
    else:
        held, held_prompts = None, _prompt_ids(heldout, V, "heldout") if heldout is not None else []
    if out_dir is not None:
        out_dir = check_distill_dir(out_dir)
    draft.train().requires_grad_(not config.lora)
    if config.lora:
        _add_lora(draft, config)  # peft leaves only the adapters trainable
    if config.freeze_embeddings:
        draft.embed.weight.requires_grad_(False)
    draft.rope()  # build the rope tables outside generate()'s inference mode
    if not any(p.requires_grad for p in draft.parameters()):
        raise ValueError("nothing to train: freeze_embeddings froze the only trainable weights")
    task = DraftTask(target, draft, train_prompts, held, held_prompts, config, eos_token_id, out_dir)
    if out_dir is None:
        return _train(task, config, None, tokenizer, deadline, resume, stop_after)
    with created_output(out_dir):  # a run that fails before it wrote anything leaves no new directory
        return _train(task, config, out_dir, tokenizer, deadline, resume, stop_after)


def _train(task: DraftTask, config: DistillConfig, out_dir: Path | None, tokenizer, deadline: float | None,
           resume: bool, stop_after: int | None):
    """`distill_draft`'s training, saving and report for a checked `task`, into `out_dir` (which
    exists) or nowhere; returns the draft."""
    ckpt = StepCheckpoints(out_dir / CHECKPOINTS) if out_dir is not None else None
    run = Trainer(task, config, out_dir, ckpt).fit(deadline, resume, stop_after)
    raw = run.raw
    if config.lora:
        merge_lora(raw)
    draft = raw.eval().requires_grad_(False)
    if out_dir is not None and run.acc.is_main_process:
        save_draft(draft, out_dir, tokenizer, SAVE_DTYPES[config.save_dtype])
    evals = run.evals
    panels = [Panel("held-out acceptance (greedy)", "agreement with the target's greedy answers",
                    [(*series(evals, "agreement"), "top-1 agreement (teacher-forced)")],
                    twin=[(*series(evals, "tau"), "tau (speculative decoding)")],
                    twin_label="tau (tokens / target forward)", marker="o")] if evals else []
    run.report({"processes": run.acc.num_processes, "losses": run.losses, "heldout": evals,
                "heldout_prompts": len(task.held_prompts), "train_prompts": len(task.prompts)}, panels)
    return draft
