"""What row-invariant forwards cost: plain and speculative decoding with the row-invariant kernels
against the batch-dependent ones, alternating per prompt in one process.

    python benchmarks/row_invariant_cost.py --out runs/row_invariant_cost                   # 1.5B bf16, 0.5B draft
    python benchmarks/row_invariant_cost.py --weights gguf --out runs/row_invariant_cost_gguf  # the 4-bit default
    python benchmarks/row_invariant_cost.py --model smollm2-135m-instruct --draft ngram --limit 4 --out runs/ric_quick
    python benchmarks/row_invariant_cost.py --weights gguf --dtype float32 --draft ngram --out runs/ric_f32  # AVX2's

For each of `--limit` HumanEval prompts (chat template, greedy, `--max-new-tokens`), the four runs
plain / speculative x row-invariant on / off go in a rotating order; the target and the draft
model are loaded (and compiled, with --compile) once, and `Transformer.want_row_invariant` switches
the kernels (a compiled model keeps one program per setting). A warm-up prompt runs every
combination first. Reported: median tok/s per run (new tokens / wall seconds of the whole call,
prefill included), the on / off ratio for plain and speculative decoding (paired: geometric mean
of the per-prompt ratios), and how many prompts' speculative output equals plain decoding's in
each setting. Writes row_invariant_cost.json and .md to --out. Write the CPU (printed) next to
the figures.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch

import runtime
import specdec
from runtime.atomic import atomic_write_text
from runtime.hardware import cpu_summary
from specdec.evaluation.prompts import encode, load_prompts


def _timed(target, ids: torch.Tensor, draft, max_new: int, k) -> tuple[list[int], float]:
    start = time.perf_counter()
    out = specdec.generate(target, [ids], draft=draft, max_new_tokens=max_new, num_draft_tokens=k)
    seconds = time.perf_counter() - start
    return out.sequences[0][ids.numel():].tolist(), seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct", help="a draft model, or ngram")
    p.add_argument("--num-draft-tokens", default="auto")
    p.add_argument("--weights", default="dense", choices=["dense", "gguf"])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="activations (float32: row-invariant with --weights gguf only)")
    p.add_argument("--limit", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    k = args.num_draft_tokens if args.num_draft_tokens == "auto" else int(args.num_draft_tokens)

    print(cpu_summary(), flush=True)
    dtype = getattr(torch, args.dtype)
    target = runtime.load_model(args.model, dtype=dtype, weights=args.weights, compile=args.compile)
    models = [target]
    draft = args.draft
    if draft != "ngram":
        draft = runtime.load_model(draft, dtype=dtype, weights=args.weights, compile=args.compile)
        models.append(draft)
    tok = runtime.load_tokenizer(args.model)
    prompts = [torch.tensor(encode(tok, [pr.turns[0]], [], raw=False))
               for pr in load_prompts(dataset="humaneval", limit=args.limit + 1)]
    runs = [(mode, on) for mode in ("plain", "spec") for on in (True, False)]

    def run(ids, mode, on):
        for m in models:
            m.want_row_invariant = on
        return _timed(target, ids, draft if mode == "spec" else None, args.max_new_tokens, k)

    for mode, on in runs:  # warm-up: every program of both settings compiles here
        run(prompts[0], mode, on)
    rows = []
    for i, ids in enumerate(prompts[1:]):
        order = runs[i % 4:] + runs[:i % 4]
        got = {f"{mode}-{'on' if on else 'off'}": run(ids, mode, on) for mode, on in order}
        rows.append({name: {"tok_s": len(t) / s, "tokens": t} for name, (t, s) in got.items()})
        print(f"prompt {i + 1}/{len(prompts) - 1}: " + ", ".join(f"{n} {r['tok_s']:.2f}" for n, r in rows[-1].items()),
              flush=True)

    def median(name):
        return statistics.median(r[name]["tok_s"] for r in rows)

    def paired(a, b):
        return math.exp(statistics.fmean(math.log(r[a]["tok_s"] / r[b]["tok_s"]) for r in rows))

    summary = {
        "cpu": cpu_summary(), "args": vars(args), "prompts": len(rows),
        "median_tok_s": {n: median(n) for n in rows[0]},
        "plain_on_over_off": paired("plain-on", "plain-off"),
        "spec_on_over_off": paired("spec-on", "spec-off"),
        "spec_matches_plain_on": sum(r["spec-on"]["tokens"] == r["plain-on"]["tokens"] for r in rows),
        "spec_matches_plain_off": sum(r["spec-off"]["tokens"] == r["plain-off"]["tokens"] for r in rows),
        "plain_on_equals_off": sum(r["plain-on"]["tokens"] == r["plain-off"]["tokens"] for r in rows),
    }
    lines = [f"Row-invariant kernels against batch-dependent ones: {args.model} {args.dtype} ({args.weights}), draft "
             f"{args.draft}@{args.num_draft_tokens}, {len(rows)} HumanEval chat prompts, {args.max_new_tokens} "
             f"tokens, {'compiled' if args.compile else 'eager'}; {summary['cpu']}", "",
             "| run | median tok/s |", "|---|---|"]
    lines += [f"| {n} | {v:.2f} |" for n, v in summary["median_tok_s"].items()]
    lines += ["", f"on / off (paired): plain {summary['plain_on_over_off']:.3f}, speculative "
              f"{summary['spec_on_over_off']:.3f}; speculative == plain: on {summary['spec_matches_plain_on']}/"
              f"{len(rows)}, off {summary['spec_matches_plain_off']}/{len(rows)}"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "row_invariant_cost.json", json.dumps({"summary": summary, "rows": rows}, indent=1))
    atomic_write_text(out / "row_invariant_cost.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
