"""specdec's exports run in llama.cpp: the same prompts, acceptance there next to acceptance here.

    python benchmarks/llamacpp_export_check.py --target smollm2-135m-instruct \\
        --eagle runs/eagle_smollm2_llamacpp --out runs/llamacpp_check
    python benchmarks/llamacpp_export_check.py --target qwen2.5-coder-1.5b-instruct \\
        --draft qwen2.5-coder-0.5b-instruct --dataset humaneval --out runs/llamacpp_check_qwen

The target (and --draft) are exported with `specdec export gguf` (dense bf16, so both engines hold
the same weights; a .gguf target is used as it is) and the EAGLE-3 head with `--target`. One
`specdec eval` run (greedy, methods alternating per prompt, `--dtype float32` here by default)
then decodes every prompt with specdec's plain decoding and `eagle:HEAD@K:Kx1` (a chain of exactly
K drafts) / `draft:X@K`, and with llama.cpp's plain decoding and `llamacpp-eagle3:HEAD.gguf@K`
(also exactly K, no probability cut-off) / `llamacpp-spec:DRAFT.gguf@K` (llama.cpp's own draft
policy: it stops drafting below p 0.75, so its acceptance is not the same measure).

Reported: per drafter, acceptance (accepted / drafted tokens) and tau (tokens per target pass)
in both engines and their ratio (the EAGLE-3 target: within 10%), and on how many prompts
llama.cpp's speculative output equals its own plain output (target: all). Writes check.json and
check.md to --out (the eval run's files are in --out/eval).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from quant.gguf_export import export_gguf
from runtime.atomic import atomic_write_text
from runtime.hardware import cpu_summary
from specdec.evaluation.evaluate import EvalConfig, command_line, read_generations, run_eval
from specdec.evaluation.llamacpp import build_options

TOLERANCE = 0.10  # the bound on |llama.cpp / specdec - 1| for an EAGLE-3 head's acceptance


def _export(source: str, out: Path, dense_type: str, target: str | None = None) -> Path:
    if source.endswith(".gguf") and target is None:
        return Path(source)
    if not out.is_file():
        print(export_gguf(source, out, target=target, dense_type=dense_type).summary(), file=sys.stderr)
    return out


def _totals(records: list[dict]) -> dict:
    """Drafted, accepted, target passes and tokens summed over a method's prompts (None without stats)."""
    stats = [r["stats"] for r in records if r.get("stats")]
    if not stats:
        return {}
    drafted = sum(s["drafted_tokens"] for s in stats)
    accepted = sum(s["accepted_tokens"] for s in stats)
    passes = sum(s["target_forwards"] for s in stats)
    tokens = sum(s["generated_tokens"] for s in stats)
    return {"drafted": drafted, "accepted": accepted, "acceptance": accepted / drafted if drafted else 0.0,
            "tau": tokens / passes if passes else 0.0}


def compare(records: list[dict], ours: str, theirs: str) -> dict:
    """One drafter in both engines: acceptance and tau of each, their ratios, and the prompts whose
    llama.cpp speculative output equals llama.cpp's plain output (and ours equals our plain)."""
    by = {}
    for r in records:
        by.setdefault(r["method"], {})[r["id"]] = r
    ids = sorted(by.get("llamacpp", {}))

    def same(method: str, plain: str) -> int:
        return sum(by[method][i]["output_ids"] == by[plain][i]["output_ids"] for i in ids if i in by[method])

    a, b = _totals(list(by[ours].values())), _totals(list(by[theirs].values()))
    return {"specdec": {"method": ours, **a, "equals_plain": same(ours, "plain")},
            "llamacpp": {"method": theirs, **b, "equals_plain": same(theirs, "llamacpp")},
            "prompts": len(ids),
            "acceptance_ratio": b["acceptance"] / a["acceptance"] if a.get("acceptance") else None,
            "tau_ratio": b["tau"] / a["tau"] if a.get("tau") else None}


def _options(options: dict[str, str]) -> str:
    return ", ".join(f"{k}={v}" for k, v in options.items()) or "unknown options (no CMakeCache.txt)"


def markdown(result: dict) -> str:
    lines = [f"# llama.cpp runs specdec's exports ({result['date']})", "",
             f"Target `{result['target']}`, {result['dataset']} x {result['limit']}, greedy, "
             f"{result['max_new_tokens']} new tokens, {result['dtype']} here, GGUF float tensors "
             f"{result['dense_type']}; CPU: {result['cpu']}; llama.cpp built with "
             f"{_options(result.get('llamacpp_build', {}))}.", "",
             f"Command: `{result['command']}`", "",
             "| drafter | engine | method | acceptance | tau | speculative == plain | acceptance ratio | tau ratio |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for name, c in result["comparisons"].items():
        for engine in ("specdec", "llamacpp"):
            e = c[engine]
            ratio = (f"{c['acceptance_ratio']:.3f}", f"{c['tau_ratio']:.3f}") if engine == "llamacpp" else ("", "")
            lines.append(f"| {name} | {engine} | `{e['method']}` | {e.get('acceptance', 0):.3f} "
                         f"| {e.get('tau', 0):.2f} | {e['equals_plain']}/{c['prompts']} | {ratio[0]} | {ratio[1]} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True, help="catalogue name, checkpoint directory or .gguf")
    p.add_argument("--eagle", default=None, help="an EAGLE-3 head directory trained for the target")
    p.add_argument("--draft", default=None, help="a draft model (catalogue name, directory or .gguf)")
    p.add_argument("-k", type=int, default=4, help="drafted tokens per step, in both engines")
    p.add_argument("--dataset", default="sharegpt", choices=("sharegpt", "humaneval"))
    p.add_argument("--limit", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="specdec's dtype")
    p.add_argument("--dense-type", default="bf16", choices=("bf16", "f16", "f32"),
                   help="float tensors of the exported target, draft and head (what llama.cpp computes in)")
    p.add_argument("--out", required=True, type=Path)
    args = p.parse_args()
    if args.eagle is None and args.draft is None:
        p.error("pass --eagle HEAD_DIR and/or --draft MODEL")
    args.out.mkdir(parents=True, exist_ok=True)
    target = _export(args.target, args.out / "target.gguf", args.dense_type)
    k = args.k
    methods, pairs = ["plain", "llamacpp"], {}
    if args.eagle:
        head = _export(args.eagle, args.out / "eagle3.gguf", args.dense_type, target=str(target))
        pairs["EAGLE-3"] = (f"eagle:{args.eagle}@{k}:{k}x1", f"llamacpp-eagle3:{head}@{k}")
    if args.draft:
        draft = _export(args.draft, args.out / "draft.gguf", args.dense_type)
        pairs["draft model"] = (f"draft:{draft}@{k}", f"llamacpp-spec:{draft}@{k}")
    methods += [m for pair in pairs.values() for m in pair]
    cfg = EvalConfig(out=str(args.out / "eval"), methods=",".join(methods), target=str(target), dataset=args.dataset,
                     limit=args.limit, max_new_tokens=args.max_new_tokens, dtype=args.dtype, weights="dense",
                     num_draft_tokens=k)
    run_eval(cfg, command=command_line("eval", cfg))
    records = read_generations(args.out / "eval" / "generations.jsonl")
    from datetime import date

    cpu = cpu_summary()
    result = {"date": date.today().isoformat(), "target": args.target, "dataset": args.dataset, "limit": args.limit,
              "max_new_tokens": args.max_new_tokens, "dtype": args.dtype, "k": k,
              "dense_type": args.dense_type, "llamacpp_build": build_options(),
              "cpu": "{model}, {cores} cores, {flags}".format(**{**cpu, "flags": " ".join(cpu["flags"])}),
              "command": "python benchmarks/llamacpp_export_check.py " + " ".join(sys.argv[1:]),
              "comparisons": {name: compare(records, ours, theirs) for name, (ours, theirs) in pairs.items()}}
    atomic_write_text(args.out / "check.json", json.dumps(result, indent=2) + "\n")
    atomic_write_text(args.out / "check.md", markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
