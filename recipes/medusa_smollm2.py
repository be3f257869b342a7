"""Recipe: Medusa heads for smollm2-135m-instruct, trained on this CPU, then evaluated.

    python recipes/medusa_smollm2.py --out runs/medusa_smollm2 --max-minutes 20

Steps, all inside the --max-minutes budget (each step resumes if the run is restarted, and the
restarted run goes on against the same budget: OUT/budget.json holds the minutes spent):
1. self-distillation data: the model's greedy answers to ShareGPT calibration prompts
   (OUT/selfdistill.jsonl) until `data_frac` of the budget;
2. last hidden states (OUT/hidden_cache, kept while step 1 generates), then Medusa-1 training
   of 4 heads until `train_frac` of the budget (default: all but `eval_minutes`, the
   evaluation's reserve); the heads' tree is built from held-out accuracy (OUT holds them:
   `distill.load_medusa(OUT, model)`);
3. evaluation (in --eval-dtype) on held-out ShareGPT prompts: tau and equality with plain greedy decoding for a
   batch of prompts (OUT/tau.json), and tokens/s against plain decoding per prompt with
   `specdec eval` (OUT/eval/report.json), with the heads' own tree or, with --speed-nodes, a copy of
   the heads in OUT/speed_tree whose tree has that many nodes ("auto": the size that times fastest
   on this machine, OUT/speed_tree/tree_cost.json).
`--eval-only` runs step 3 alone on the heads already in --out. `pipeline()` is shared with
recipes/medusa_qwen_coder_1_5b.py. --out must be new, empty or a run of these recipes (which it
resumes): a file, or a directory specdec did not write, is refused before any work.
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

import distill
import runtime
import specdec
from distill.budget import RunBudget, run_budgeted
from distill.command import parse_num_nodes, parse_share, parse_sizes
from distill.config_args import add_dataclass_args, dataclass_from_args
from distill.data.code_prompts import function_prompts, interleave
from distill.data.features import cache_hidden_states
from distill.data.selfdistill import (
    generate_selfdistill,
    is_code_prompt,
    read_records,
    sharegpt_prompts,
    stop_token_ids,
)
from distill.medusa.train import TRAIN_MARKERS, MedusaTrainConfig
from runtime.atomic import atomic_write_text
from runtime.hardware import DTYPES
from specdec.drafters.medusa.heads import MedusaHeads, choose_tree
from specdec.evaluation.evaluate import EvalConfig, run_eval
from specdec.evaluation.prompts import encode, load_prompts
from specdec.methods import DrafterSpec
from specdec.tuning.tree_cost import cost_report, describe, measure_trees

# files that mark a run directory of these recipes: with one of them, --out is resumed
RUN_MARKERS = (*TRAIN_MARKERS, "metrics.json", "train_run.json", "tau.json", "summary.json")


def tau_on_prompts(model, heads, rows: list[torch.Tensor], max_new_tokens: int, eos: list[int]) -> dict:
    """Greedy Medusa vs plain decoding on `rows` as one batch: tau, per-depth acceptance, equality.
    Each decoding is one batched call, so it reports when each starts and how long it took."""
    start = time.monotonic()
    print(f"[tau] plain decoding of {len(rows)} prompts, one batch ...", flush=True)
    plain = specdec.generate(model, rows, max_new_tokens=max_new_tokens, eos_token_id=eos)
    print(f"[tau] plain took {(time.monotonic() - start) / 60:.1f} min; Medusa decoding with a "
          f"{len(heads.tree.paths)}-node tree ...", flush=True)
    start = time.monotonic()
    med = specdec.generate(model, rows, draft=heads, max_new_tokens=max_new_tokens, eos_token_id=eos)
    print(f"[tau] Medusa took {(time.monotonic() - start) / 60:.1f} min", flush=True)
    same = [torch.equal(a, b) for a, b in zip(med.sequences, plain.sequences)]
    return {"prompts": len(rows), "max_new_tokens": max_new_tokens,
            "tau": med.stats.mean_accepted_tokens,
            "per_position_acceptance": med.stats.per_position_acceptance,
            "matches_plain": sum(same) / len(same),
            "batch_tokens_per_second": {"plain": plain.stats.tokens_per_second,
                                        "medusa": med.stats.tokens_per_second},
            "stats": med.stats.to_dict()}


def speed_tree(args: argparse.Namespace, model, heads: MedusaHeads, row: torch.Tensor, out: Path) -> Path:
    """The heads with the tree the speed comparison uses, saved to OUT/speed_tree: --speed-nodes
    nodes, or with "auto" the size among --speed-sizes with the highest expected speed when timed
    on this machine (specdec.tuning.tree_cost, decoding the prompt `row`; the timings go to
    OUT/speed_tree/tree_cost.json). On a CPU the tree forward grows with the tree, so the tree
    that gives the highest tau is not the fastest (BENCHMARKS.md section 5)."""
    table = [list(r) for r in heads.config.head_accuracy]
    nodes, report = args.speed_nodes, None
    if nodes == "auto":
        plain, costs = measure_trees(model, heads, row, args.speed_sizes, table)
        print(describe(plain, costs), flush=True)
        report = cost_report(plain, costs)
        nodes = report["chosen_nodes"]
    choose_tree(heads, table, nodes)
    dest = out / "speed_tree"
    distill.save_medusa(heads, dest, overwrite=True)  # this recipe's own copy, rebuilt on every run
    if report is not None:
        atomic_write_text(dest / "tree_cost.json", json.dumps(report, indent=1))
    print(f"[speed] tree of {nodes} nodes ({dest})", flush=True)
    return dest


def train(args: argparse.Namespace, model, tok, out: Path, budget: RunBudget) -> tuple[list[dict], dict, float]:
    """Self-distillation data, hidden-state cache and head training, each until its deadline."""
    limit = args.num_prompts or round(args.prompts_per_minute * args.max_minutes)
    prompts = sharegpt_prompts(tok, split="calibration", limit=limit,
                               max_prompt_tokens=args.max_prompt_tokens,
                               keep=is_code_prompt if getattr(args, "code_prompts", False) else None)
    if args.function_share > 0:  # HumanEval-shaped prompts from this machine's Python sources
        stubs = function_prompts(tok, max_prompt_tokens=args.max_prompt_tokens, cache=out / "function_stubs.json")
        print(f"[data] {len(stubs)} function stubs, {len(prompts)} ShareGPT prompts, "
              f"{args.function_share:.0%} stubs", flush=True)
        prompts = interleave(stubs, prompts, args.function_share)
    cache_dir = out / "hidden_cache"  # filled during generation: no second pass over the answers
    n = generate_selfdistill(model, tok, out / "selfdistill.jsonl", prompts,
                             max_new_tokens=args.answer_tokens, batch_size=args.generation_batch,
                             deadline=budget.at(args.data_frac), hidden_cache=cache_dir, num_heads=args.num_heads)
    records = read_records(out / "selfdistill.jsonl")
    print(f"[data] {n} answers, {sum(len(r['output_ids']) for r in records)} tokens, "
          f"{budget.minutes():.1f} min", flush=True)

    cache_hidden_states(model, records, cache_dir, args.num_heads, deadline=budget.at(args.train_frac))
    heads = distill.attach_medusa(model, num_heads=args.num_heads, num_layers=args.num_layers)
    cfg = dataclass_from_args(MedusaTrainConfig, args)
    metrics = distill.train_medusa(heads, cache_dir, out, cfg, deadline=budget.at(args.train_frac))
    train_min = budget.minutes()
    print(f"[train] {metrics['steps']}/{metrics['planned_steps']} steps, top-1 accuracy "
          f"{[round(a, 3) for a in metrics['top1_accuracy']]}, {train_min:.1f} min", flush=True)
    atomic_write_text(out / "train_run.json", json.dumps({"command": shlex.join(["python"] + sys.argv),
                                                          "args": vars(args), "train_minutes": train_min}, indent=1))
    return records, metrics, train_min


def pipeline(args: argparse.Namespace, model_name: str, eval_dataset: str, raw_eval: bool) -> dict:
    """Data -> hidden-state cache -> training -> evaluation, bounded by args.max_minutes; a restarted
    run resumes every step and goes on against the same budget (OUT/budget.json)."""
    start = time.monotonic()
    return run_budgeted(args, RUN_MARKERS, "Medusa recipe run directory", "heads",
                        lambda out, budget: _run(args, model_name, eval_dataset, raw_eval, out, budget, start))


def _run(args: argparse.Namespace, model_name: str, eval_dataset: str, raw_eval: bool, out: Path,
         budget: RunBudget | None, start: float) -> dict:
    """The pipeline's steps (budget None: --eval-only)."""
    if budget is not None and budget.spent_before:
        print(f"[budget] resuming {out}: {budget.spent_before:.1f} of {args.max_minutes:g} minutes already "
              "spent (budget.json)" + ("; the budget is spent, so data and training stop at once and only "
                                       "the evaluation runs: raise --max-minutes to go on"
                                       if budget.spent_before >= args.max_minutes * args.train_frac else ""),
              flush=True)
    model = runtime.load_model(model_name, dtype=DTYPES[args.dtype], weights="dense")
    tok = runtime.load_tokenizer(model_name)
    eos = stop_token_ids(tok)

    if args.eval_only:  # the heads in OUT, as a finished (or interrupted) run left them
        metrics = json.loads((out / "metrics.json").read_text())
        records = read_records(out / "selfdistill.jsonl")
        run = out / "train_run.json"
        train_min = json.loads(run.read_text())["train_minutes"] if run.is_file() else None
    else:
        records, metrics, train_min = train(args, model, tok, out, budget)

    eval_dtype = args.eval_dtype or args.dtype
    if eval_dtype != args.dtype:
        model = runtime.load_model(model_name, dtype=DTYPES[eval_dtype], weights="dense")
    heads = distill.load_medusa(out, model)
    if args.speed_prompts and args.speed_nodes is not None and heads.config.head_accuracy is None:
        raise SystemExit(f"--speed-nodes: the heads in {out} store no held-out accuracy to build a tree from; "
                         "rebuild their tree with `specdec medusa tree --data-dir` or drop --speed-nodes")
    eval_prompts = load_prompts(dataset=eval_dataset, limit=args.eval_prompts)
    rows = [torch.tensor(encode(tok, [p.turns[0]], [], raw_eval)) for p in eval_prompts]
    tau = tau_on_prompts(model, heads, rows, args.eval_tokens, eos)
    tau.update({"train_minutes": train_min, "dataset": eval_dataset, "dtype": eval_dtype})
    atomic_write_text(out / "tau.json", json.dumps(tau, indent=1))
    print(f"[tau] {tau['tau']:.3f} on {len(rows)} {eval_dataset} prompts, matches plain "
          f"{tau['matches_plain']:.2f}", flush=True)

    speed, speed_heads = None, out
    if args.speed_prompts:
        if args.speed_nodes is not None:
            speed_heads = speed_tree(args, model, heads, rows[0], out)
        medusa = DrafterSpec("medusa", str(speed_heads))
        cfg_eval = EvalConfig(out=str(out / "eval"), methods=f"plain,{medusa}", target=model_name,
                              dataset=eval_dataset, limit=args.speed_prompts, raw=raw_eval,
                              dtype=eval_dtype, max_new_tokens=args.eval_tokens, overwrite=True)
        report = run_eval(cfg_eval, command=shlex.join([sys.executable] + sys.argv))
        speed = report
        for name, m in report["methods"].items():
            o = m["overall"]
            print(f"[speed] {name}: tau {o['tau']:.3f}, {o['tokens_per_second']:.2f} tokens/s, "
                  f"speedup vs plain {o['speedup_vs_plain']:.2f}, matches plain {o['matches_plain']}",
                  flush=True)
    minutes = budget.minutes() if budget is not None else (time.monotonic() - start) / 60
    summary = {"command": shlex.join(["python"] + sys.argv), "args": vars(args), "minutes": minutes,
               "train_minutes": train_min, "tau": tau["tau"], "matches_plain": tau["matches_plain"],
               "top1_accuracy": metrics["top1_accuracy"], "records": len(records),
               "train_positions": metrics["train_positions"],
               "speed_tree_nodes": len(heads.tree.paths) if speed is not None else None,
               "speed": {name: {k: m["overall"][k] for k in ("tau", "tokens_per_second", "speedup_vs_plain",
                                                             "matches_plain")}
                         for name, m in speed["methods"].items()} if speed is not None else None}
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return summary


def parser(defaults: dict, train: dict, doc: str = __doc__) -> argparse.ArgumentParser:
    """The recipes' shared options; `defaults` holds the recipe's own settings, `train` the
    MedusaTrainConfig values it uses instead of the library's (every other training flag defaults to
    MedusaTrainConfig's), `doc` the calling recipe's module docstring (its first paragraph becomes
    --help's description)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--out", default=defaults["out"], help="directory for data, cache, heads, reports")
    p.add_argument("--max-minutes", type=float, default=defaults["max_minutes"])
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="dtype of generation and training (default auto: bfloat16 where the CPU or GPU "
                        "multiplies it natively, float32 elsewhere: on an AVX2-only CPU batched bf16 work runs "
                        "several times slower; runtime.hardware)")
    p.add_argument("--eval-dtype", default=None, choices=["bfloat16", "float32"],
                   help="dtype of the evaluation (default: --dtype); float32 makes greedy Medusa output "
                        "bit-comparable with plain decoding")
    p.add_argument("--eval-only", action="store_true",
                   help="skip data and training: evaluate the heads already in --out")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="ShareGPT calibration conversations read for prompts (about 15%% qualify; default "
                        f"{defaults['prompts_per_minute']} per minute of --max-minutes, more than the data "
                        "phase can answer)")
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--function-share", type=parse_share, default=defaults["function_share"],
                   help="share of the prompts that are function stubs (signature + docstring, HumanEval's "
                        "shape) cut from this machine's Python sources, interleaved with the ShareGPT ones "
                        "(distill.data.code_prompts); 0 = ShareGPT only")
    p.add_argument("--answer-tokens", type=int, default=defaults["answer_tokens"])
    p.add_argument("--batch-size", dest="generation_batch", type=int, default=defaults["batch_size"],
                   help="rows per self-distillation batch (--train-batch: positions per training step)")
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-layers", type=int, default=defaults["num_layers"], help="residual blocks per head")
    p.add_argument("--data-frac", type=float, default=defaults["data_frac"],
                   help="fraction of the budget for self-distillation data")
    p.add_argument("--train-frac", type=float, default=None,
                   help="fraction of the budget by which training ends (evaluation uses the rest; default: "
                        "all but --eval-minutes)")
    p.add_argument("--eval-minutes", type=float, default=defaults["eval_minutes"],
                   help="minutes kept for the evaluation when --train-frac is not given (default "
                        f"{defaults['eval_minutes']:g}; a larger tree takes longer: 3.9 min for 128 nodes "
                        "on smollm2)")
    p.add_argument("--eval-prompts", type=int, default=defaults["eval_prompts"])
    p.add_argument("--eval-tokens", type=int, default=defaults["eval_tokens"])
    p.add_argument("--speed-prompts", type=int, default=defaults["speed_prompts"],
                   help="prompts timed one at a time by specdec eval (0 = skip)")
    own = "the heads' own tree, --tree-nodes"
    p.add_argument("--speed-nodes", type=parse_num_nodes, default=defaults["speed_nodes"],
                   help=f"tree size for the speed comparison (default: {defaults['speed_nodes'] or own}); 'auto' "
                        "times the trees of --speed-sizes on this machine and keeps the one with the highest "
                        "expected speed")
    p.add_argument("--speed-sizes", type=parse_sizes, default="1,2,4,6,8,12,16,24",
                   help="tree sizes --speed-nodes auto tries")
    p.set_defaults(prompts_per_minute=defaults["prompts_per_minute"])
    add_dataclass_args(p.add_argument_group("head training (MedusaTrainConfig)"), MedusaTrainConfig,
                       flags={"batch_size": "--train-batch"}, defaults=train)
    return p


# measured on this CPU (BENCHMARKS.md section 5): the evaluation takes ~2.6 min (eval_minutes
# keeps 3.5); the heads over-fit a few hundred thousand positions within a few epochs, so the
# budget goes mostly to data; two residual layers per head beat one (held-out top-1 0.311 vs
# 0.289 after the same 3 minutes of training)
DEFAULTS = {"out": "runs/medusa_smollm2", "max_minutes": 20.0, "answer_tokens": 128, "batch_size": 64,
            "prompts_per_minute": 1500, "num_layers": 2, "data_frac": 0.55, "eval_minutes": 3.5,
            "eval_prompts": 12, "eval_tokens": 96, "speed_prompts": 2, "speed_nodes": None, "function_share": 0.0}
# where this recipe trains differently from MedusaTrainConfig's defaults (docs/medusa.md, "Results"):
# vocab "data" because on a CPU the softmax over the 49k-token shared LM head is most of a training
# step; 3 epochs because more did not raise the held-out accuracy (the budget goes to data
# instead); 64 nodes, the size of Medusa's own default tree, ~0.03 expected tokens per step over 40
TRAIN = {"vocab": "data", "epochs": 3, "tree_nodes": 64}

if __name__ == "__main__":
    run(lambda: pipeline(parser(DEFAULTS, TRAIN).parse_args(), "smollm2-135m-instruct", "sharegpt", raw_eval=False))
