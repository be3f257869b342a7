"""Recipe: recover smollm2-135m-instruct pruned to 2:4 (SparseGPT) by distillation from the dense model.

    python recipes/recover_smollm2_24.py --max-minutes 60 --out runs/recover24
    accelerate launch --num_processes 8 recipes/recover_smollm2_24.py --max-minutes 60 --out runs/recover24

1. SparseGPT 2:4 of the dense model, calibrated on ShareGPT + code windows, saved to OUT/sparse
   (a compressed checkpoint; a rerun loads it instead of pruning again).
2. Held-out perplexity of the dense and the sparse model on ShareGPT (held-out slice) and code
   (Python stdlib) windows, which training never sees (OUT/baseline.json).
3. distill.recover from the dense teacher on ShareGPT + code calibration-slice windows for what
   is left of --max-minutes after a reserve for step 4 (OUT/train: checkpoints, recovery.png,
   metrics.json). The budget (OUT/budget.json) holds across restarts: the same command resumes.
4. The recovered model saved as a compressed checkpoint (OUT/recovered), loaded back with
   runtime.load_model, checked to be exactly 2:4, and scored on the held-out windows.
5. OUT/report.json and OUT/report.md: perplexities of dense, sparse and recovered, and the
   fraction of the perplexity gap recovered, (sparse - recovered) / (sparse - dense), per set.

--max-minutes budgets steps 3-4 (the recovery); steps 1-2 are timed and reported on their own.
Under `accelerate launch` every process trains on its slice of each batch; only the main process
prunes, saves and writes reports.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch
from recipe_errors import run
from safetensors.torch import load_file, save_file

import distill
import quant
import runtime
from distill.budget import RunBudget
from distill.config_args import add_dataclass_args, dataclass_from_args
from distill.recover.train import RECOVER_MARKERS, RecoverConfig
from runtime.argtypes import path_arg
from runtime.atomic import atomic_write, atomic_write_text
from runtime.hardware import cpu_summary
from runtime.output_paths import prepare_output_dir
from runtime.qlinear import Sparse24Linear

MODEL = "smollm2-135m-instruct"
MARKERS = ("baseline.json", "budget.json", "report.json") + tuple(f"train/{m}" for m in RECOVER_MARKERS)
SETS = {"sharegpt": "ShareGPT held-out", "stdlib": "code (Python stdlib)"}
# the recipe's own defaults for RecoverConfig: a step of 4 x 256 tokens costs ~20-40 s on 2 CPU cores,
# so 60 minutes are a few hundred steps; the cosine decay follows the deadline
DEFAULTS = {"steps": 4000, "batch_size": 4, "micro_batch": 4, "lr": 2e-4, "warmup_steps": 10, "eval_every": 20,
            "checkpoint_every": 10}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=path_arg, required=True, help="run directory (a rerun with the same OUT resumes)")
    ap.add_argument("--max-minutes", type=float, default=60.0, help="budget of the recovery and its final evaluation")
    ap.add_argument("--n-calib", type=int, default=64, help="SparseGPT calibration windows (ShareGPT + code)")
    ap.add_argument("--method", default="sparsegpt", choices=("sparsegpt", "wanda", "magnitude"),
                    help="2:4 pruning method (magnitude: instant, for a quick check of the pipeline)")
    ap.add_argument("--n-train", type=int, default=4096, help="training windows (ShareGPT + code calibration slice)")
    ap.add_argument("--seq-len", type=int, default=256, help="tokens per training and calibration window")
    ap.add_argument("--n-eval", type=int, default=16, help="held-out perplexity windows per set")
    ap.add_argument("--eval-seq-len", type=int, default=512, help="tokens per held-out window")
    ap.add_argument("--threads", type=int, default=0, help="torch threads per process (0: torch's default)")
    add_dataclass_args(ap.add_argument_group("recovery (distill.RecoverConfig)"), RecoverConfig, defaults=DEFAULTS)
    args = ap.parse_args()
    for name in ("n_calib", "n_train", "n_eval"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_minutes <= 0:
        ap.error("--max-minutes must be > 0")
    return args


def _windows(path: Path, make) -> torch.Tensor:
    """Token windows cached in `path` (safetensors), built by `make()` the first time."""
    if path.is_file():
        return load_file(str(path))["windows"]
    windows = make()
    atomic_write(path, lambda tmp: save_file({"windows": windows.contiguous()}, tmp))
    return windows


def _ppl(model, evals: dict[str, torch.Tensor]) -> dict[str, float]:
    return {src: round(quant.perplexity(model, w, progress=True), 4) for src, w in evals.items()}


def _check_24(model) -> int:
    """Raise unless every group of four inputs of every Sparse24Linear has at most two nonzeros; returns the count."""
    mods = [m for m in model.modules() if isinstance(m, Sparse24Linear)]
    for m in mods:
        w = m.dequantize()  # (N, K)
        if int((w != 0).view(w.shape[0], -1, 4).sum(-1).max()) > 2:
            raise RuntimeError("the recovered model is not 2:4 sparse")
    return len(mods)


def _prepare(args, out: Path, tok) -> dict:
    """Steps 1-2 (main process): the sparse checkpoint and the baseline perplexities."""
    path = out / "baseline.json"
    if path.is_file():
        base = json.loads(path.read_text())
        if base["method"] != args.method:
            raise ValueError(f"{out} holds a model pruned with {base['method']}, not {args.method}; use another --out")
        return base
    evals = _windows(out / "eval_windows.safetensors", lambda: _eval_windows(tok, args))
    evals = {src: evals[i::len(SETS)] for i, src in enumerate(SETS)}
    t0 = time.perf_counter()
    dense = runtime.load_model(MODEL, dtype=torch.bfloat16, weights="dense")
    dense_ppl = _ppl(dense, evals)
    eval_s = time.perf_counter() - t0
    del dense
    t0 = time.perf_counter()
    sparse = runtime.load_model(MODEL, dtype=torch.bfloat16, weights="dense")
    cfg = quant.SemiStructured24(method=args.method)
    calib = quant.calibration_batches(tok, "sharegpt+code", n_samples=args.n_calib, seq_len=args.seq_len) \
        if cfg.needs_calibration else None
    quant.sparsify_(sparse, cfg, calibration=calib)
    quant.save_compressed(sparse, out / "sparse", tokenizer=tok, overwrite=True)
    prune_s = time.perf_counter() - t0
    base = {"method": args.method, "dense": dense_ppl, "sparse": _ppl(sparse, evals),
            "prune_seconds": round(prune_s, 1), "eval_seconds_per_model": round(eval_s, 1)}
    atomic_write_text(path, json.dumps(base, indent=1))
    return base


def _eval_windows(tok, args) -> torch.Tensor:
    """Both held-out sets interleaved (row i belongs to set i % 2): one tensor to cache."""
    sets = [quant.eval_batches(tok, src, n_samples=args.n_eval, seq_len=args.eval_seq_len) for src in SETS]
    return torch.stack([w for pair in zip(*sets) for w in pair])  # (2 * n_eval, T)


def _gap(dense: float, sparse: float, recovered: float) -> float:
    return round((sparse - recovered) / (sparse - dense), 4) if sparse != dense else float("nan")


def _markdown(report: dict) -> str:
    b, r = report["baseline"], report["recovered"]
    lines = [f"# smollm2-135m-instruct 2:4 ({b['method']}), recovered by distillation", "",
             f"Command: `{report['command']}`  ", f"Machine: {report['machine']}; processes: {report['processes']}", "",
             "| perplexity | " + " | ".join(SETS.values()) + " |", "|---|" + "---:|" * len(SETS)]
    for name, row in (("dense", b["dense"]), (f"2:4 {b['method']}", b["sparse"]), ("2:4 recovered", r)):
        lines.append(f"| {name} | " + " | ".join(f"{row[s]:.3f}" for s in SETS) + " |")
    lines.append("| gap recovered | " + " | ".join(f"{100 * report['gap_recovered'][s]:.1f}%" for s in SETS) + " |")
    lines += ["", f"Recovery: {report['steps']} steps of {report['config']['batch_size']} windows x "
                  f"{report['window_tokens']} tokens in {report['recovery_minutes']:.1f} min "
                  f"(budget {report['max_minutes']} min); pruning {b['prune_seconds']:.0f} s.", ""]
    return "\n".join(lines)


def main() -> None:
    from accelerate import PartialState

    args = parse_args()
    config = dataclass_from_args(RecoverConfig, args)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = prepare_output_dir(args.out, MARKERS, what="recovery run", resume=True)
    state = PartialState()  # one device per process: the GPU accelerate assigns it, else the CPU
    tok = runtime.load_tokenizer(MODEL)
    with state.main_process_first():
        if state.is_main_process:
            out.mkdir(parents=True, exist_ok=True)
            base = _prepare(args, out, tok)
        else:
            base = json.loads((out / "baseline.json").read_text())
        train = _windows(out / "train_windows.safetensors", lambda: quant.calibration_batches(
            tok, "sharegpt+code", n_samples=args.n_train, seq_len=args.seq_len))  # (N, T)
        evals = load_file(str(out / "eval_windows.safetensors"))["windows"]
    evals = {src: evals[i::len(SETS)] for i, src in enumerate(SETS)}
    monitor = torch.cat([w[:1] for w in evals.values()])  # (2, T): the perplexity followed during training
    teacher = runtime.load_model(MODEL, dtype=torch.bfloat16, device=state.device, weights="dense")
    student = runtime.load_model(out / "sparse", dtype=torch.bfloat16, device=state.device, weights="dense")
    reserve = 1.5 * base["eval_seconds_per_model"] + 30  # final evaluation + save / load
    budget = RunBudget(out / "budget.json", args.max_minutes) if state.is_main_process else None
    try:
        deadline = budget.at(1) - reserve if budget else time.monotonic() + 1e9  # others follow the main clock
        metrics = distill.recover(student, teacher, train, config, out / "train", heldout=monitor, deadline=deadline)
        if not state.is_main_process:
            return
        ckpt = quant.save_compressed(student, out / "recovered", tokenizer=tok, overwrite=True)
        back = runtime.load_model(ckpt, dtype=torch.bfloat16, weights="dense")
        n_sparse = _check_24(back)
        recovered = _ppl(back, evals)
        minutes = budget.minutes()
    finally:
        if budget is not None:
            budget.close()
    cpu = cpu_summary()
    report = {
        "model": MODEL, "baseline": base, "recovered": recovered,
        "gap_recovered": {s: _gap(base["dense"][s], base["sparse"][s], recovered[s]) for s in SETS},
        "monitor_perplexity": metrics["evals"], "steps": metrics["steps"], "window_tokens": int(train.shape[1]),
        "train_windows": int(train.shape[0]), "sparse_linears_checked": n_sparse,
        "recovery_minutes": round(minutes, 2), "max_minutes": args.max_minutes, "processes": state.num_processes,
        "config": metrics["config"], "command": shlex.join([sys.executable, *sys.argv]),
        "machine": f"{cpu['model']} ({cpu['cores']} cores; {', '.join(cpu['flags']) or 'no AVX2'}), "
                   f"{torch.get_num_threads()} threads, torch {torch.__version__}",
        "monitor_eval_windows": int(monitor.shape[0]), "heldout_windows_per_set": args.n_eval,
    }
    atomic_write_text(out / "report.json", json.dumps(report, indent=1))
    atomic_write_text(out / "report.md", _markdown(report))
    print(_markdown(report))


if __name__ == "__main__":
    run(main)
