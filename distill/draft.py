"""DistillSpec draft distillation (Zhou et al. 2023): train a draft model toward its target.

Each step (`distill_draft`):
1. rows: `batch_size` prompts per process and micro-step, in an order shuffled per epoch by a
   generator seeded with `seed` + epoch; answers from `distill.onpolicy` (the draft's own samples
   by default, the target's answers, or a GKD-style mix), sampled with a torch.Generator seeded
   by (seed, step, micro-step, process), so a resumed run draws the same data;
2. the target scores the answer positions once under no_grad (logits only there:
   `logits_idx`), the draft scores them with gradients, and `distill.divergence` (fkl, rkl, jsd,
   tvd at `temperature`) averaged over the answer tokens is the loss;
3. AdamW on every trainable weight of the draft (full fine-tuning; `freeze_embeddings` keeps the
   embedding, and a tied LM head with it, fixed) or on LoRA adapters (`lora`, via peft; merged
   into the weights before saving), linear warm-up then cosine decay (the deadline-aware schedule
   of distill.train_medusa), gradient clipping, bf16 autocast of the draft's forward where the
   hardware multiplies bf16 natively. `accelerate` holds the device and gradient accumulation, so
   the same loop runs under `accelerate launch --num_processes N` (DDP: each process its own
   rows; each process's loss is weighted by its share of the step's answer tokens, so the
   averaged gradient and the logged loss are those of the mean over all of them, and every
   process follows the main process's clock: distill.accel).

Every `eval_every` steps the main process measures held-out acceptance: the draft's top-1
agreement with the target's greedy answers to the held-out prompts, teacher-forced
(`distill.heldout`: the per-token acceptance probability of greedy speculative decoding, without
sampling noise; the answers are generated once and kept in OUT/heldout_answers.json), and, with
`eval_decode`, greedy speculative decoding of the target with the draft (a copy in the target's
dtype) on those prompts (`specdec.generate`; tau and the acceptance rate of its AcceptanceStats).
OUT receives atomic checkpoints every `checkpoint_every` steps (OUT/distill_checkpoint/step-N:
the trainable weights as safetensors, optimizer.pt of tensors only, trainer.json; `latest.json`
names the newest, written last), the distilled draft as a Hugging Face checkpoint
(model.safetensors + config.json + tokenizer: `runtime.load_model(OUT)`, `specdec eval --methods
draft:OUT`, `quant` compresses it), distill_metrics.json and distill.png (loss and held-out
acceptance over the steps).
"""

from __future__ import annotations

import copy
import functools
import json
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import specdec
from distill.accel import autocast_mode, global_mean, synced_clock
from distill.code_prompts import STUB_CACHE
from distill.config_args import at_least, check_fields, positive
from distill.divergence import DIVERGENCES, masked_divergence
from distill.heldout import HeldoutSet, agreement, target_answers
from distill.onpolicy import DATA_SOURCES, batch_source, make_batch, sample_answers
from distill.train_medusa import set_lr
from runtime.atomic import atomic_write, atomic_write_text
from runtime.hf_state import dense_hf_state
from runtime.outputs import prepare_output_dir
from runtime.progress import progress

CHECKPOINTS = "distill_checkpoint"
HELDOUT_ANSWERS = "heldout_answers.json"
LATEST = "latest.json"
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
class DistillConfig:
    """Draft distillation settings: the one declaration of their defaults (`specdec distill draft`
    and recipes/distill_qwen05_draft.py derive their flags from these fields).

    Defaults: on-policy data and forward KL at temperature 1 (DistillSpec's greedy-decoding
    setting); full fine-tuning, because LoRA was not measured to give more held-out acceptance per
    CPU-minute (see docs/distillation.md); lr and batch are starting points for a CPU budget.
    """

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
    lr: float = field(default=1e-5, metadata={"help": "peak AdamW learning rate (warm-up, then cosine decay)",
                                              "check": positive})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay", "check": at_least(0)})
    warmup_steps: int = field(default=10, metadata={"help": "steps of linear learning-rate warm-up",
                                                    "check": at_least(0)})
    max_grad_norm: float = field(default=1.0, metadata={"help": "gradient clipping: largest total gradient norm",
                                                        "check": positive})
    freeze_embeddings: bool = field(default=False, metadata={
        "help": "keep the token embedding fixed (and a tied LM head with it)"})
    lora: bool = field(default=False, metadata={
        "help": "train LoRA adapters on the attention and MLP linears (peft) instead of every weight; merged "
                "into the weights before saving"})
    lora_rank: int = field(default=16, metadata={"help": "LoRA rank", "check": at_least(1)})
    lora_alpha: float = field(default=32.0, metadata={"help": "LoRA alpha (scale alpha / rank)", "check": positive})
    mixed_precision: str = field(default="auto", metadata={
        "help": "autocast mode of the draft's training forward; auto: bf16 where the hardware multiplies it "
                "natively, else float32", "choices": ("auto", "no", "bf16")})
    checkpoint_every: int = field(default=25, metadata={"help": "steps between resumable checkpoints",
                                                        "check": at_least(1)})
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
    seed: int = field(default=0, metadata={"help": "seed of the prompt order, the samples and the adapters"})

    def __post_init__(self) -> None:
        check_fields(self)

    def autocast_mode(self, device: torch.device) -> str:
        """The autocast mode of training on `device`, "bf16" or "no" ("auto" resolved)."""
        return autocast_mode(self.mixed_precision, device)


def check_distill_dir(out_dir: str | Path) -> Path:
    """Fail (OutputPathError) unless `out_dir` is new, empty or a draft distillation directory."""
    return prepare_output_dir(out_dir, TRAIN_MARKERS, what="draft distillation directory", resume=True)


def _prompt_ids(prompts) -> list[list[int]]:
    """Prompt token lists from lists of ids, 1-D tensors or (id, ids) pairs (distill.selfdistill's)."""
    out = []
    for p in prompts:
        if isinstance(p, tuple) and len(p) == 2 and not isinstance(p[1], int):
            p = p[1]
        ids = p.tolist() if isinstance(p, torch.Tensor) else list(p)
        if not ids:
            raise ValueError("an empty prompt: every prompt needs at least one token")
        out.append([int(t) for t in ids])
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
    from peft import LoraConfig, inject_adapter_in_model

    with torch.random.fork_rng(devices=[]):  # the adapters' initialisation, without touching the global RNG
        torch.manual_seed(config.seed)
        lora = LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha, lora_dropout=0.0,
                          target_modules=list(LORA_TARGETS))
        return inject_adapter_in_model(lora, model)


def merge_lora(model) -> torch.nn.Module:
    """Fold every peft LoRA adapter of `model` into its base linear and put the linear back, in place."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for name, module in list(model.named_modules()):
        if isinstance(module, BaseTunerLayer):
            module.merge()
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, module.get_base_layer())
    return model


def _trainable_state(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().to("cpu", torch.float32).contiguous() for n, p in model.named_parameters()
            if p.requires_grad}


def _save_checkpoint(root: Path, step: int, model, opt, state: dict, keep: int = 1) -> None:
    """OUT/distill_checkpoint/step-N written in a temporary directory renamed into place, then
    latest.json (atomically) names it; older step directories beyond `keep` are removed."""
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:07d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=root))
    try:
        save_file(_trainable_state(model), str(tmp / "trainable.safetensors"))
        torch.save(opt.state_dict(), tmp / "optimizer.pt")
        (tmp / "trainer.json").write_text(json.dumps(state))
        final = root / name
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    atomic_write_text(root / LATEST, json.dumps({"checkpoint": name, "step": step}))
    for old in sorted(p for p in root.glob("step-*") if p.is_dir() and p.name != name)[:-keep or None]:
        shutil.rmtree(old, ignore_errors=True)


def _load_checkpoint(root: Path, model, opt) -> dict | None:
    """Restore the newest checkpoint into `model` and `opt`; its trainer state, or None without one."""
    if not (root / LATEST).is_file():
        return None
    ckpt = root / json.loads((root / LATEST).read_text())["checkpoint"]
    saved = load_file(str(ckpt / "trainable.safetensors"))
    params = dict(model.named_parameters())
    trainable = {n for n, p in params.items() if p.requires_grad}
    if set(saved) != trainable:
        raise ValueError(f"{ckpt} holds other trainable weights than this configuration trains (lora, "
                         "freeze_embeddings or the draft differ); use another output directory")
    with torch.no_grad():
        for n, t in saved.items():
            params[n].copy_(t)
    opt.load_state_dict(torch.load(ckpt / "optimizer.pt", weights_only=True))
    return json.loads((ckpt / "trainer.json").read_text())


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


def _plot(losses: list[float], evals: list[dict], path: Path, what: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
    left.plot(range(1, len(losses) + 1), losses, lw=0.8)
    left.set(xlabel="step", ylabel=what, title="draft distillation loss")
    agreed = [e for e in evals if "agreement" in e]
    if agreed:
        right.plot([e["step"] for e in agreed], [e["agreement"] for e in agreed], marker="o",
                   label="top-1 agreement (teacher-forced)")
    decoded = [e for e in evals if "tau" in e]
    if decoded:
        twin = right.twinx()
        twin.plot([e["step"] for e in decoded], [e["tau"] for e in decoded], marker="s", color="C1",
                  label="tau (speculative decoding)")
        twin.set_ylabel("tau (tokens / target forward)")
    right.set(xlabel="step", ylabel="agreement with the target's greedy answers", title="held-out acceptance (greedy)")
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    plt.close(fig)


def distill_draft(target, draft, prompts, config: DistillConfig = DistillConfig(), out_dir: str | Path | None = None,
                  *, heldout=None, tokenizer=None, eos_token_id: int | list[int] | None = None,
                  deadline: float | None = None, resume: bool = True, stop_after: int | None = None):
    """Distil runtime model `draft` toward runtime model `target` (frozen) and return the draft
    (trained in place; LoRA merged back; eval mode, no gradients).

    prompts: training prompts (lists of token ids, 1-D tensors, or (id, ids) pairs as
    distill.selfdistill.sharegpt_prompts returns). heldout: prompts for the held-out acceptance
    measurement (the target's greedy answers to them are generated at the first measurement), or a
    distill.heldout.HeldoutSet that already holds those answers (None: not measured). The draft
    should be float32 (it trains in place under `config.mixed_precision`); draft and target must
    share the vocabulary. out_dir: new, empty or a draft distillation directory (TRAIN_MARKERS;
    else OutputPathError), resumed from when `resume`; it receives checkpoints, the draft (with
    `tokenizer`), heldout_answers.json, distill_metrics.json and distill.png; without it nothing is
    saved. deadline: a time.monotonic() value after which no step starts (the schedule decays
    toward it). stop_after: end this call after that many steps in all (the schedule still spans
    config.steps; the same call later resumes).
    """
    from accelerate import Accelerator

    if target.config.vocab_size != draft.config.vocab_size:
        raise ValueError(f"the target scores {target.config.vocab_size} tokens and the draft "
                         f"{draft.config.vocab_size}: a draft must share its target's vocabulary")
    train_prompts = _prompt_ids(prompts)
    if not train_prompts:
        raise ValueError("no training prompts; pass prompt token lists (e.g. distill.sharegpt_prompts(tok))")
    if isinstance(heldout, HeldoutSet):
        held, held_prompts = heldout, heldout.prompts
    else:
        held, held_prompts = None, _prompt_ids(heldout) if heldout is not None else []
    if out_dir is not None:
        out_dir = check_distill_dir(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
    # autocast is applied here rather than through accelerate's process-wide mixed-precision state, which
    # refuses a second setting in one process (a test suite, --compare-divergences)
    acc = Accelerator(cpu=draft.device.type == "cpu", gradient_accumulation_steps=config.grad_accum)
    bf16 = config.autocast_mode(draft.device) == "bf16"
    draft.train().requires_grad_(not config.lora)
    if config.lora:
        _add_lora(draft, config)  # peft leaves only the adapters trainable
    if config.freeze_embeddings:
        draft.embed.weight.requires_grad_(False)
    draft.rope()  # build the rope tables outside generate()'s inference mode
    params = [p for p in draft.parameters() if p.requires_grad]
    if not params:
        raise ValueError("nothing to train: freeze_embeddings froze the only trainable weights")
    opt = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    ckpt_root = out_dir / CHECKPOINTS if out_dir is not None else None
    step, losses, evals, before = 0, [], [], 0.0
    if resume and ckpt_root is not None:
        saved = _load_checkpoint(ckpt_root, draft, opt)
        if saved is not None:
            step, losses, evals, before = saved["step"], saved["losses"], saved["evals"], saved["train_seconds"]
    model, opt = acc.prepare(draft, opt)
    # under `accelerate launch --mixed_precision`, accelerate wraps the forward in autocast; without that
    # wrapper, generation (on-policy samples, held-out acceptance) runs in the draft's own dtype and only
    # the training forward autocasts
    raw = acc.unwrap_model(model, keep_fp32_wrapper=False)
    device, n, world = acc.device, len(train_prompts), acc.num_processes
    per_micro = config.batch_size * world

    @functools.lru_cache(maxsize=2)
    def order_for(epoch: int) -> list[int]:
        return torch.randperm(n, generator=torch.Generator().manual_seed(_seed(config.seed, epoch))).tolist()

    def measure() -> None:
        nonlocal held
        if held_prompts and acc.is_main_process:
            if held is None:
                held = heldout_set(target, held_prompts, config, eos_token_id, out_dir)
            raw.eval()
            record = {"step": step, **agreement(raw, held, config.eval_draft_tokens, bf16=bf16)}
            if config.eval_decode:
                # the draft as it will serve, in the target's dtype (a bf16 copy reads half the bytes of float32)
                probe = raw if raw.dtype == target.dtype else copy.deepcopy(raw).to(target.dtype)
                record.update(heldout_acceptance(target, probe.eval(), held_prompts, config, eos_token_id))
                del probe
            raw.train()
            evals.append(record)
            bar.set_postfix(loss=f"{losses[-1]:.4f}" if losses else "-", agree=f"{record['agreement']:.3f}",
                            refresh=False)
        acc.wait_for_everyone()

    last = config.steps if stop_after is None else min(config.steps, stop_after)
    bar = progress(total=config.steps, initial=min(step, config.steps), desc="distilling the draft", unit="step",
                   disable=not acc.is_main_process)
    t_start = time.monotonic()

    def seconds() -> float:
        return before + time.monotonic() - t_start

    def state() -> dict:
        return {"step": step, "losses": losses, "evals": evals, "train_seconds": seconds(), "config": asdict(config)}

    if step == 0 and not evals:
        measure()  # the undistilled draft's acceptance: the curve's first point
    try:
        while step < last:
            spent, step_deadline, stop = synced_clock(acc, seconds(), deadline)  # every process stops together
            if stop:
                break
            set_lr(opt, step, config.steps, spent, step_deadline, config)
            step_loss = 0.0
            for micro in range(config.grad_accum):
                start = (step * config.grad_accum + micro) * per_micro + acc.process_index * config.batch_size
                rows = [train_prompts[i] for i in _rows(order_for, n, start, config.batch_size)]
                gen = torch.Generator(device=device).manual_seed(_seed(config.seed, step, micro, acc.process_index))
                source = batch_source(config.data, config.mixed_lambda, gen)
                raw.eval()
                answers = sample_answers(raw if source == "draft" else target, rows, config.max_new_tokens,
                                         config.sample_temperature if source == "draft" else config.target_temperature,
                                         gen, eos_token_id)
                raw.train()
                batch = make_batch(rows, answers).to(device)
                with torch.no_grad():
                    teacher = target(batch.tokens, batch.positions, None, logits_idx=batch.idx).logits  # (B, N, V)
                with acc.accumulate(model):
                    with torch.autocast(acc.device.type, dtype=torch.bfloat16, enabled=bf16):
                        student = model(batch.tokens, batch.positions, None, logits_idx=batch.idx).logits  # (B, N, V)
                    loss = masked_divergence(student, teacher, batch.valid, config.divergence, config.temperature,
                                             config.beta) * _token_weight(batch.answer_tokens, acc)
                    acc.backward(loss)
                    if acc.sync_gradients:
                        acc.clip_grad_norm_(params, config.max_grad_norm)
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                step_loss += global_mean(loss, acc) / config.grad_accum
                del teacher, student
            step += 1
            losses.append(step_loss)
            bar.set_postfix(loss=f"{step_loss:.4f}", refresh=False)
            bar.update(1)
            if step % config.eval_every == 0 or step == config.steps:
                measure()
            if ckpt_root is not None and step % config.checkpoint_every == 0 and acc.is_main_process:
                _save_checkpoint(ckpt_root, step, raw, opt, state())
    finally:  # also when stopped (Ctrl-C, SIGTERM): the steps done so far are kept
        bar.close()
        if ckpt_root is not None and acc.is_main_process and step and not (
                ckpt_root / f"step-{step:07d}").is_dir():
            _save_checkpoint(ckpt_root, step, raw, opt, state())
    if evals and evals[-1]["step"] != step:
        measure()
    if config.lora:
        merge_lora(raw)
    draft = raw.eval().requires_grad_(False)
    if out_dir is not None and acc.is_main_process:
        save_draft(draft, out_dir, tokenizer, SAVE_DTYPES[config.save_dtype])
        if losses:
            _plot(losses, evals, out_dir / "distill.png", f"{config.divergence} per answer token")
        metrics = {"steps": step, "planned_steps": config.steps, "processes": world, "losses": losses,
                   "final_loss": sum(losses[-10:]) / len(losses[-10:]) if losses else None,
                   "heldout": evals, "heldout_prompts": len(held_prompts), "train_prompts": n,
                   "train_seconds": seconds(), "config": asdict(config)}
        atomic_write_text(out_dir / METRICS, json.dumps(metrics, indent=1))
    acc.wait_for_everyone()
    return draft
