"""Recipe: an EAGLE-3 head for smollm2-135m-instruct, trained on this CPU, then evaluated.

    python recipes/eagle_smollm2.py --out runs/eagle_smollm2 --max-minutes 30

Steps, all inside the --max-minutes budget (each step resumes when the run is restarted with the
same command, and the restarted run goes on against the same budget: OUT/budget.json holds the
minutes spent):
1. self-distillation data: the target's greedy answers to ShareGPT calibration prompts
   (OUT/selfdistill.jsonl, distill.generate_selfdistill) until `data_frac` of the budget, with the
   target's aux-layer and final states from those same forwards (OUT/eagle_cache); then, with
   --answers-frac, the target's features over ShareGPT's own answers read teacher-forced
   (distill.data.dataset_answers, OUT/eagle_cache_answers) until `data_frac + answers_frac`;
2. EAGLE-3 training with training-time test (distill.train_eagle) until `train_frac` of the budget
   (default: all but `eval_minutes`); the head is saved in OUT in the speculators format
   (`specdec.load_eagle(OUT, target)`), with OUT/metrics.json (per-depth held-out accuracy) and
   OUT/loss.png;
3. evaluation with `specdec eval`, methods --baselines and `eagle:OUT@TREE:DxK` (--eagle-tree: the
   tree's nodes, default auto: the size that is fastest on this machine; --eagle-depth D and
   --eagle-top-k K its shape), on held-out prompts
   (OUT/eval/report.json: tau, per-depth acceptance, tokens/s, speedups, equality with plain
   decoding), summarised in OUT/summary.json.
`--eval-only` runs step 3 alone on the head already in --out. `pipeline()` is shared with
recipes/eagle_qwen_coder_1_5b.py. --out must be new, empty or a run of these recipes (which it
resumes): a file, or a directory specdec did not write, is refused before any work.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from recipe_errors import run

import distill
import runtime
from distill.budget import RunBudget, default_train_frac, run_budgeted
from distill.command import parse_share
from distill.config_args import add_dataclass_args, dataclass_from_args
from distill.data.code_prompts import STUB_CACHE, function_prompts, interleave
from distill.data.dataset_answers import cache_answer_states
from distill.data.features import cache_eagle_states, read_manifest
from distill.data.selfdistill import generate_selfdistill, is_code_prompt, read_records, sharegpt_prompts
from distill.eagle.train import ANSWERS_CACHE_DIR, CACHE_DIR, TRAIN_MARKERS, EagleTrainConfig
from runtime.atomic import atomic_write_text
from runtime.hardware import DTYPES
from specdec.cli import tree_nodes_arg
from specdec.drafters.eagle.drafter import EagleTreeConfig
from specdec.evaluation.evaluate import EvalConfig, run_eval
from specdec.methods import DrafterSpec

# files that mark a run directory of these recipes: with one of them, --out is resumed
RUN_MARKERS = (*TRAIN_MARKERS, "metrics.json", "summary.json")


def train(args: argparse.Namespace, model, tok, out: Path, budget: RunBudget) -> tuple[list[dict], dict, float]:
    """Self-distillation data, feature cache and head training, each until its deadline."""
    limit = args.num_prompts or round(args.prompts_per_minute * args.max_minutes)
    prompts = sharegpt_prompts(tok, split="calibration", limit=limit, max_prompt_tokens=args.max_prompt_tokens,
                               keep=is_code_prompt if getattr(args, "code_prompts", False) else None)
    if args.function_share > 0:  # HumanEval-shaped prompts from this machine's Python sources
        stubs = function_prompts(tok, max_prompt_tokens=args.max_prompt_tokens, cache=out / STUB_CACHE)
        print(f"[data] {len(stubs)} function stubs, {len(prompts)} ShareGPT prompts, "
              f"{args.function_share:.0%} stubs", flush=True)
        prompts = interleave(stubs, prompts, args.function_share)
    cfg = dataclass_from_args(EagleTrainConfig, args)
    layers = cfg.layers(model.config.num_layers)
    # the features come from generation's own forwards (no second pass over the answers)
    n = generate_selfdistill(model, tok, out / "selfdistill.jsonl", prompts, max_new_tokens=args.answer_tokens,
                             batch_size=args.generation_batch, deadline=budget.at(args.data_frac),
                             eagle_cache=out / CACHE_DIR, aux_layers=layers, heldout_every=cfg.heldout_every)
    records = read_records(out / "selfdistill.jsonl")
    print(f"[data] {n} answers, {sum(len(r['output_ids']) for r in records)} tokens, "
          f"{budget.minutes():.1f} min", flush=True)
    deadline = budget.at(args.train_frac)
    # records a stopped run wrote without their features are cached here (a no-op otherwise)
    caches = [cache_eagle_states(model, records, out / CACHE_DIR, layers, heldout_every=cfg.heldout_every,
                                 deadline=deadline)]
    if args.answers_frac > 0:  # ShareGPT's own answers, read teacher-forced (distill.data.dataset_answers)
        caches.append(cache_answer_states(model, tok, out / ANSWERS_CACHE_DIR, layers, args.answer_records,
                                          args.dataset_answer_tokens, args.max_prompt_tokens,
                                          deadline=min(budget.at(args.data_frac + args.answers_frac), deadline)))
        done = read_manifest(caches[-1])["records_done"]
        print(f"[data] features of {done} ShareGPT answers (teacher-forced), {budget.minutes():.1f} min", flush=True)
    distill.train_eagle(model, caches, cfg, out, deadline=deadline)
    metrics = json.loads((out / "metrics.json").read_text())
    train_min = budget.minutes()
    held = metrics["heldout"] or {}
    print(f"[train] {metrics['steps']}/{metrics['planned_steps']} steps, held-out per-depth accuracy "
          f"{[round(a, 3) for a in held.get('accuracy_per_step', [])]}, {train_min:.1f} min", flush=True)
    return records, metrics, train_min


def pipeline(args: argparse.Namespace, model_name: str, eval_dataset: str, raw_eval: bool) -> dict:
    """Data -> feature cache -> training -> evaluation, bounded by args.max_minutes; a restarted run
    resumes every step and goes on against the same budget (OUT/budget.json)."""
    start = time.monotonic()
    _check_answers(args)
    _eagle_method(args, Path(args.out))  # a bad tree fails now, not after the training
    return run_budgeted(args, RUN_MARKERS, "EAGLE-3 recipe run directory", "head",
                        lambda out, budget: _run(args, model_name, eval_dataset, raw_eval, out, budget, start))


def _eagle_method(args: argparse.Namespace, out: Path) -> str:
    """The `specdec eval` method of the head in `out` with the tree of --eagle-tree/-depth/-top-k
    (a DrafterSpec, checked on construction)."""
    return str(DrafterSpec("eagle", str(out), args.eagle_tree, (args.eagle_depth, args.eagle_top_k)))


def _check_answers(args: argparse.Namespace) -> None:
    """Refuse --answers-frac settings that could not train, before any work."""
    if args.answers_frac <= 0:
        return
    if args.answer_records < 1 or args.dataset_answer_tokens < 1:
        raise ValueError(f"--answer-records and --dataset-answer-tokens must be >= 1, got {args.answer_records} "
                         f"and {args.dataset_answer_tokens}")
    train_frac = args.train_frac if args.train_frac is not None else default_train_frac(args)
    if args.data_frac + args.answers_frac >= train_frac:
        raise ValueError(f"--data-frac {args.data_frac:g} + --answers-frac {args.answers_frac:g} leave no training: "
                         f"training ends at {train_frac:.2f} of the budget; lower them or raise --max-minutes")


def _run(args: argparse.Namespace, model_name: str, eval_dataset: str, raw_eval: bool, out: Path,
         budget: RunBudget | None, start: float) -> dict:
    """The pipeline's steps (budget None: --eval-only)."""
    if budget is not None and budget.spent_before:
        print(f"[budget] resuming {out}: {budget.spent_before:.1f} of {args.max_minutes:g} minutes already spent "
              "(budget.json)", flush=True)
    if args.eval_only:
        metrics, train_min = json.loads((out / "metrics.json").read_text()), None
        records = read_records(out / "selfdistill.jsonl")
    else:
        model = runtime.load_model(model_name, dtype=DTYPES[args.dtype], weights="dense")
        records, metrics, train_min = train(args, model, runtime.load_tokenizer(model_name), out, budget)
        del model
    eval_dtype = args.eval_dtype or args.dtype
    methods = ",".join([*filter(None, args.baselines.split(",")), _eagle_method(args, out)])
    cfg = EvalConfig(out=str(out / "eval"), methods=methods, target=model_name, dataset=eval_dataset,
                     limit=args.eval_prompts, raw=raw_eval, dtype=eval_dtype, max_new_tokens=args.eval_tokens,
                     overwrite=True)
    report = run_eval(cfg, command=shlex.join([sys.executable] + sys.argv))
    speed = {name: {k: m["overall"].get(k) for k in ("tau", "per_position_acceptance", "tokens_per_second",
                                                     "speedup_vs_plain", "matches_plain")}
             for name, m in report["methods"].items()}
    for name, row in speed.items():
        print(f"[eval] {name}: {json.dumps(row)}", flush=True)
    minutes = budget.minutes() if budget is not None else (time.monotonic() - start) / 60
    summary = {"command": shlex.join(["python"] + sys.argv), "args": vars(args), "minutes": minutes,
               "train_minutes": train_min, "records": len(records), "train_positions": metrics["train_positions"],
               "heldout_accuracy_per_step": (metrics["heldout"] or {}).get("accuracy_per_step"),
               "eval_dataset": eval_dataset, "eval": speed}
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return summary


def parser(defaults: dict, train: dict, doc: str = __doc__) -> argparse.ArgumentParser:
    """The recipes' shared options; `defaults` holds the recipe's own settings, `train` the
    EagleTrainConfig values it uses instead of the library's (every other training flag defaults to
    EagleTrainConfig's), `doc` the calling recipe's module docstring (its first paragraph becomes
    --help's description)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--out", default=defaults["out"], help="directory for data, cache, head, reports")
    p.add_argument("--max-minutes", type=float, default=defaults["max_minutes"],
                   help="budget of data, training and evaluation together, across restarts (default: %(default)s)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="target dtype of generation and feature caching (default auto: bfloat16 where the CPU or "
                        "GPU multiplies it natively, float32 elsewhere; runtime.hardware)")
    p.add_argument("--eval-dtype", default=None, choices=["bfloat16", "float32"],
                   help="dtype of the evaluation (default: --dtype); float32 makes greedy EAGLE output "
                        "bit-comparable with plain decoding")
    p.add_argument("--eval-only", action="store_true", help="skip data and training: evaluate the head in --out")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="ShareGPT calibration conversations read for prompts (default "
                        f"{defaults['prompts_per_minute']} per minute of --max-minutes)")
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--function-share", type=parse_share, default=defaults["function_share"],
                   help="share of the prompts that are function stubs cut from this machine's Python sources "
                        "(distill.data.code_prompts); 0 = ShareGPT only")
    p.add_argument("--answer-tokens", type=int, default=defaults["answer_tokens"], help="answer length cap")
    p.add_argument("--batch-size", dest="generation_batch", type=int, default=defaults["batch_size"],
                   help="rows per self-distillation batch (--batch-tokens: tokens per training step)")
    p.add_argument("--data-frac", type=float, default=defaults["data_frac"],
                   help="fraction of the budget for self-distillation data")
    p.add_argument("--answers-frac", type=parse_share, default=defaults["answers_frac"],
                   help="fraction of the budget, after --data-frac, for the features of ShareGPT's own answers read "
                        "teacher-forced (distill.data.dataset_answers: ~2x the positions per minute of generation); "
                        "training reads them beside the target's own answers (default: %(default)s)")
    p.add_argument("--answer-records", type=int, default=defaults["answer_records"],
                   help="ShareGPT answers prepared for --answers-frac (the deadline ends caching first)")
    p.add_argument("--dataset-answer-tokens", type=int, default=defaults["dataset_answer_tokens"],
                   help="length cap of a ShareGPT answer read with --answers-frac")
    p.add_argument("--train-frac", type=float, default=None,
                   help="fraction of the budget by which caching and training end (default: all but --eval-minutes)")
    p.add_argument("--eval-minutes", type=float, default=defaults["eval_minutes"],
                   help="minutes kept for the evaluation when --train-frac is not given")
    p.add_argument("--eval-prompts", type=int, default=defaults["eval_prompts"])
    p.add_argument("--eval-tokens", type=int, default=defaults["eval_tokens"])
    p.add_argument("--baselines", default=defaults["baselines"],
                   help="`specdec eval` methods run beside eagle:OUT, comma-separated (default: %(default)s)")
    p.add_argument("--eagle-tree", type=tree_nodes_arg, default="auto", metavar="N|auto",
                   help="nodes of the evaluated draft tree (at most top_k + (depth - 1) * top_k^2), or auto: time "
                        "the sizes up to 64 on this machine first (default: %(default)s)")
    p.add_argument("--eagle-depth", type=int, default=EagleTreeConfig.depth,
                   help="levels of the evaluated draft tree (default: %(default)s)")
    p.add_argument("--eagle-top-k", type=int, default=EagleTreeConfig.top_k,
                   help="children per expanded node and nodes expanded per level of the evaluated draft tree "
                        "(default: %(default)s)")
    p.set_defaults(prompts_per_minute=defaults["prompts_per_minute"])
    add_dataclass_args(p.add_argument_group("head training (EagleTrainConfig)"), EagleTrainConfig, defaults=train)
    return p


# starting points, not measured settings: half the budget for answers (the head learns from the
# target's own text), 12 held-out ShareGPT prompts for the evaluation (the smollm2 target)
DEFAULTS = {"out": "runs/eagle_smollm2", "max_minutes": 30.0, "answer_tokens": 128, "batch_size": 64,
            "prompts_per_minute": 1500, "data_frac": 0.45, "eval_minutes": 5.0, "eval_prompts": 12,
            "eval_tokens": 96, "function_share": 0.0, "baselines": "plain",
            "answers_frac": 0.0, "answer_records": 4000, "dataset_answer_tokens": 256}
# what the 30-minute run in BENCHMARKS.md section 5 used: an 8k draft vocabulary (smollm2's answers on a
# CPU budget use ~6.4k distinct tokens; it covers 91% of held-out answer tokens), steps of 1024 tokens
# (more, smaller steps: the head learned more per CPU minute than with 2048), and enough epochs that
# the deadline, not the schedule, ends training
TRAIN = {"draft_vocab_size": 8192, "epochs": 20, "batch_tokens": 1024}

if __name__ == "__main__":
    run(lambda: pipeline(parser(DEFAULTS, TRAIN).parse_args(), "smollm2-135m-instruct", "sharegpt", raw_eval=False))
