"""Recipe: distil the qwen2.5-coder-0.5b-instruct draft toward qwen2.5-coder-1.5b-instruct (DistillSpec), then
evaluate it against the undistilled draft in one `specdec eval` run.

    python recipes/distill_qwen05_draft.py --out runs/distill_qwen05 --max-minutes 180
    python recipes/distill_qwen05_draft.py --out runs/distill_compare --compare-divergences --compare-minutes 10

Steps, all inside the --max-minutes budget (a restart with the same command resumes each step
and goes on against the same budget: OUT/budget.json holds the minutes spent):
1. distillation (distill.distill_draft) on chat prompts (ShareGPT calibration) and HumanEval-shaped
   function stubs from this machine's Python sources, with held-out acceptance measured on the last
   prompts of ShareGPT's held-out slice, until `train_frac` of the budget (default: all but
   --eval-minutes); the draft goes to OUT/draft (`draft:OUT/draft`), with distill.png and
   distill_metrics.json;
2. one `specdec eval` run (OUT/eval/report.json) over --eval-prompts ShareGPT held-out prompts and as
   many HumanEval problems (chat template; --eval-sets picks the sets and their order), greedy,
   --eval-tokens new tokens, compiled, with methods plain, draft:<undistilled>@auto,
   draft:OUT/draft@auto and hf; OUT/summary.json holds tau and speed per method and category.
--eval-only runs step 2 alone on the draft already in OUT/draft.

--compare-divergences instead trains every divergence (fkl, rkl, jsd, tvd) with every data source
(on-policy, target, mixed), and forward KL on on-policy data with LoRA adapters (at
--compare-lora-lr), each from the undistilled draft for --compare-minutes of wall clock (equal CPU
time on one machine), and tabulates the held-out top-1 agreement with the target's greedy answers
(teacher-forced, distill.draft.heldout; the answers are generated once for every run) and the
cross-entropy on them, before and after, in OUT/compare.md and OUT/compare.json; each run
(OUT/compare/<divergence>-<data>[-lora]) resumes; a finished run keeps its metrics and plot, and
its distilled weights only with --compare-keep-drafts.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import time
from pathlib import Path

import torch
from recipe_errors import run

import runtime
from distill.budget import RunBudget, run_budgeted
from distill.command import add_prompt_args
from distill.config_args import add_dataclass_args, dataclass_from_args
from distill.data.code_prompts import STUB_CACHE
from distill.data.selfdistill import stop_token_ids
from distill.divergence import DIVERGENCES
from distill.draft.onpolicy import DATA_SOURCES, heldout_prompts, training_prompts
from distill.draft.train import CHECKPOINTS, METRICS, DistillConfig, distill_draft, heldout_set
from runtime.atomic import atomic_write_text
from runtime.hardware import DTYPES
from specdec.evaluation.evaluate import EvalConfig, run_eval
from specdec.evaluation.prompts import DATASETS, load_prompts
from specdec.methods import DrafterSpec

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
# files that mark a run directory of this recipe: with one of them, --out is resumed
RUN_MARKERS = ("budget.json", "summary.json", "compare.json", f"draft/{METRICS}")


def _distil(args: argparse.Namespace, cfg: DistillConfig, target, tok, prompts, held, out: Path,
            deadline: float | None) -> dict:
    """One distillation of a fresh copy of the undistilled draft into `out`; its metrics."""
    draft = runtime.load_model(args.draft, dtype=torch.float32, weights="dense")
    distill_draft(target, draft, prompts, cfg, out, heldout=held, tokenizer=tok, eos_token_id=stop_token_ids(tok),
                  deadline=deadline)
    return json.loads((out / METRICS).read_text())


def _eval_prompts(out: Path, count: int, datasets: list[str]) -> Path:
    """OUT/eval_prompts.jsonl: the first `count` prompts of each of `datasets`, in that order."""
    path = out / "eval_prompts.jsonl"
    rows = [{"id": p.id, "category": p.category, "prompt": p.turns[0]}
            for dataset in datasets for p in load_prompts(dataset=dataset, limit=count)]
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows))
    return path


def evaluate(args: argparse.Namespace, out: Path, fresh: bool) -> dict:
    """The one `specdec eval` run of step 2 (resumed unless the draft was trained again: `fresh`)."""
    drafts = [DrafterSpec("draft", str(path), "auto") for path in (args.draft, out / "draft")]
    methods = ["plain", *map(str, drafts), "hf"]
    prompts = _eval_prompts(out, args.eval_prompts, args.eval_sets)
    cfg = EvalConfig(out=str(out / "eval"), methods=",".join(methods), target=args.target,
                     prompts=str(prompts), dtype=args.eval_dtype or args.dtype,
                     max_new_tokens=args.eval_new_tokens, compile=not args.no_compile, overwrite=fresh)
    report = run_eval(cfg, command=shlex.join([sys.executable] + sys.argv))
    keys = ("tau", "acceptance_rate", "tokens_per_second", "speedup_vs_plain", "speedup_vs_hf", "matches_plain")
    table = {}
    for name, m in report["methods"].items():
        parts = {"overall": m["overall"], **m["categories"]}
        table[name] = {part: {k: row.get(k) for k in keys} for part, row in parts.items()}
    return table


def _run(args: argparse.Namespace, out: Path, budget: RunBudget | None, start: float) -> dict:
    if budget is not None and budget.spent_before:
        print(f"[budget] resuming {out}: {budget.spent_before:.1f} of {args.max_minutes:g} minutes already spent",
              flush=True)
    metrics, fresh = None, False
    if not args.eval_only:
        tok = runtime.load_tokenizer(args.draft)
        prompts = training_prompts(tok, args.num_prompts, args.max_prompt_tokens, args.code_share,
                                   stub_cache=out / STUB_CACHE if args.code_share > 0 else None)
        held = heldout_prompts(tok, args.heldout_prompts, args.max_prompt_tokens)
        print(f"[data] {len(prompts)} training prompts, {len(held)} held-out prompts", flush=True)
        target = runtime.load_model(args.target, dtype=DTYPES[args.dtype], weights="dense")
        before = budget.minutes()
        metrics = _distil(args, dataclass_from_args(DistillConfig, args), target, tok, prompts, held, out / "draft",
                          budget.at(args.train_frac))
        fresh = budget.minutes() - before > 0.5
        evals = metrics["heldout"]
        agree = (f"held-out agreement {evals[0]['agreement']:.3f} -> {evals[-1]['agreement']:.3f}, "
                 if evals else "")
        print(f"[train] {metrics['steps']}/{metrics['planned_steps']} steps, final loss {metrics['final_loss']}, "
              f"{agree}{budget.minutes():.1f} min", flush=True)
        del target
    table = evaluate(args, out, fresh)
    for name, parts in table.items():
        print(f"[eval] {name}: {json.dumps(parts)}", flush=True)
    minutes = budget.minutes() if budget is not None else (time.monotonic() - start) / 60
    summary = {"command": shlex.join(["python"] + sys.argv), "args": vars(args), "minutes": minutes,
               "heldout_during_training": (metrics or json.loads((out / "draft" / METRICS).read_text()))["heldout"],
               "eval": table}
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=1))
    return summary


def compare_runs(lora_lr: float) -> list[tuple[str, dict]]:
    """(run name, DistillConfig overrides) of --compare-divergences: every divergence x data source
    with full fine-tuning, then forward KL on on-policy data with LoRA adapters."""
    runs = [(f"{d}-{data}", {"divergence": d, "data": data}) for d in DIVERGENCES for data in DATA_SOURCES]
    return runs + [("fkl-on-policy-lora", {"divergence": "fkl", "data": "on-policy", "lora": True, "lr": lora_lr})]


def _drop_weights(run_dir: Path, keep_draft: bool) -> None:
    """Remove a finished compared run's resumable checkpoint and, unless `keep_draft`, its distilled
    weights: with the optimizer state the 0.5B draft's run holds ~7.5 GB, and the table needs only
    its metrics."""
    shutil.rmtree(run_dir / CHECKPOINTS, ignore_errors=True)
    if not keep_draft:
        for name in ("model.safetensors", "config.json"):  # no config left behind that promises weights
            (run_dir / name).unlink(missing_ok=True)


def compare(args: argparse.Namespace, out: Path) -> dict:
    """Every run of `compare_runs` for --compare-minutes each (each run its own budget), measured by
    teacher-forced agreement on one set of the target's held-out answers; OUT/compare.md and compare.json."""
    tok = runtime.load_tokenizer(args.draft)
    prompts = training_prompts(tok, args.num_prompts, args.max_prompt_tokens, args.code_share,
                               stub_cache=out / STUB_CACHE if args.code_share > 0 else None)
    target = runtime.load_model(args.target, dtype=DTYPES[args.dtype], weights="dense")
    base = dataclass_from_args(DistillConfig, args)
    held = heldout_set(target, heldout_prompts(tok, args.heldout_prompts, args.max_prompt_tokens), base,
                       stop_token_ids(tok), out)
    print(f"[data] {len(prompts)} training prompts, {len(held.prompts)} held-out prompts "
          f"({held.positions} answer tokens of the target)", flush=True)
    rows = []
    for name, overrides in compare_runs(args.compare_lora_lr):
        run_dir = out / "compare" / name
        cfg = dataclass_from_args(DistillConfig, args, eval_decode=False, **overrides)
        if (run_dir / METRICS).is_file():
            metrics = json.loads((run_dir / METRICS).read_text())
        else:
            with RunBudget(run_dir / "budget.json", args.compare_minutes) as clock:
                metrics = _distil(args, cfg, target, tok, prompts, held, run_dir, clock.at(1.0))
        _drop_weights(run_dir, args.compare_keep_drafts)
        first, last = metrics["heldout"][0], metrics["heldout"][-1]
        rows.append({"run": name, "divergence": cfg.divergence, "data": cfg.data, "lora": cfg.lora, "lr": cfg.lr,
                     "steps": metrics["steps"], "train_minutes": metrics["train_seconds"] / 60,
                     **{f"{key}_{when}": e[key] for key in ("agreement", "ce", "expected_tau")
                        for when, e in (("before", first), ("after", last))}})
        print(f"[compare] {json.dumps(rows[-1])}", flush=True)
    lines = ["| divergence | data | weights (lr) | steps | minutes | held-out top-1 agreement (before -> after) | "
             f"cross-entropy (nats) | expected tau at k = {base.eval_draft_tokens} |",
             "|---|---|---|---:|---:|---|---|---|"]
    lines += [f"| {r['divergence']} | {r['data']} | {'LoRA' if r['lora'] else 'full'} ({r['lr']:g}) | {r['steps']} | "
              f"{r['train_minutes']:.1f} | {r['agreement_before']:.4f} -> {r['agreement_after']:.4f} | "
              f"{r['ce_before']:.4f} -> {r['ce_after']:.4f} | "
              f"{r['expected_tau_before']:.3f} -> {r['expected_tau_after']:.3f} |" for r in rows]
    command = shlex.join(["python"] + sys.argv)
    atomic_write_text(out / "compare.md", f"`{command}`\n\n" + "\n".join(lines) + "\n")
    result = {"command": command, "rows": rows}
    atomic_write_text(out / "compare.json", json.dumps(result, indent=1))
    print("\n".join(lines))
    return result


def main() -> dict:
    args = parser().parse_args()
    start = time.monotonic()
    args.data_frac = 0.0  # no data phase: the answers are sampled during training
    if args.compare_divergences:
        if args.heldout_prompts < 1:
            raise ValueError("--compare-divergences tabulates held-out acceptance: give --heldout-prompts >= 1")
        args.eval_minutes = 0.0
        args.max_minutes = max(args.max_minutes, args.compare_minutes * len(compare_runs(args.compare_lora_lr)))
        return run_budgeted(args, RUN_MARKERS, "draft distillation recipe directory", "draft",
                            lambda out, _budget: compare(args, out))
    return run_budgeted(args, RUN_MARKERS, "draft distillation recipe directory", "draft",
                        lambda out, budget: _run(args, out, budget, start), trained=f"draft/{METRICS}")


def _eval_sets(text: str) -> list[str]:
    sets = [s.strip() for s in text.split(",") if s.strip()]
    unknown = sorted(set(sets) - set(DATASETS))
    if not sets or unknown or len(set(sets)) < len(sets):
        raise argparse.ArgumentTypeError(f"--eval-sets takes distinct names among {', '.join(DATASETS)}; got {text!r}")
    return sets


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/distill_qwen05", help="directory for the draft, checkpoints and reports")
    p.add_argument("--max-minutes", type=float, default=180.0,
                   help="budget of training and evaluation together, across restarts (default: %(default)s)")
    p.add_argument("--target", default=TARGET, help="the target (default: %(default)s)")
    p.add_argument("--draft", default=DRAFT, help="the draft to distil (default: %(default)s)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="target dtype of training (default auto: bfloat16 where it is native, else float32)")
    p.add_argument("--eval-dtype", default=None, choices=["bfloat16", "float32"],
                   help="dtype of the evaluation (default: --dtype)")
    p.add_argument("--eval-only", action="store_true", help="skip training: evaluate the draft in OUT/draft")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--train-frac", type=float, default=None,
                   help="fraction of the budget by which training ends (default: all but --eval-minutes)")
    # the evaluation decodes 2 x 20 prompts x 4 methods of 128 tokens: ~2 minutes per prompt on a 2-core
    # AVX-512-BF16 EPYC (plain ~31 s, hf ~38 s, each draft ~26 s), so ~80 minutes
    p.add_argument("--eval-minutes", type=float, default=80.0,
                   help="minutes kept for the evaluation when --train-frac is not given (default: %(default)s)")
    p.add_argument("--eval-prompts", type=int, default=20, help="prompts per set of --eval-sets")
    p.add_argument("--eval-sets", type=_eval_sets, default="sharegpt,humaneval",
                   help="comma-separated prompt sets of the evaluation, decoded in this order (a run stopped "
                        "early has finished the first ones; default: %(default)s)")
    p.add_argument("--eval-tokens", dest="eval_new_tokens", type=int, default=128,
                   help="new tokens per evaluation prompt (--heldout-tokens: per held-out prompt during training)")
    p.add_argument("--no-compile", action="store_true", help="evaluate without torch.compile")
    p.add_argument("--compare-divergences", action="store_true",
                   help="train every divergence x data source for --compare-minutes each and tabulate held-out "
                        "acceptance, instead of the recipe's single run")
    p.add_argument("--compare-minutes", type=float, default=10.0, help="wall-clock minutes per compared run")
    p.add_argument("--compare-keep-drafts", action="store_true",
                   help="keep each compared run's distilled weights (~1 GB each for the 0.5B draft); by default a "
                        "finished run keeps its metrics and plot only, and no run keeps its checkpoint")
    p.add_argument("--compare-lora-lr", type=float, default=1e-4,
                   help="peak learning rate of the compared LoRA run (adapters train at a higher rate than full "
                        "fine-tuning; default: %(default)s)")
    add_prompt_args(p)
    add_dataclass_args(p.add_argument_group("distillation (DistillConfig)"), DistillConfig,
                       flags={"eval_tokens": "--heldout-tokens", "eval_every": "--heldout-every",
                              "eval_draft_tokens": "--heldout-draft-tokens", "eval_decode": "--heldout-decode"})
    return p


if __name__ == "__main__":
    run(main)
