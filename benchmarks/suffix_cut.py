"""The suffix drafter with and without its cut, and with and without what earlier calls learnt, against
plain decoding, in one alternating run.

`specdec eval` takes drafter specs, and a spec's `suffix` always cuts its trees (SuffixConfig.cut)
and sizes them by what earlier generate() calls on the target measured (its block costs,
`specdec.tuning.costs.target_costs`, and the node calibration of the loader's tuning state); this
runs the same loop through the Python API so the variants are timed side by side: per prompt plain,
`suffix` (as a spec makes it), `suffix per call` (costs and calibration learnt from nothing in each
call, as before they were shared) and `suffix uncut` in turn after a warm-up, each variant with its
own cache of earlier answers (as `specdec eval` keeps one per method) and a new drafter per prompt
(as a spec makes one per generate() call). Prints medians of tokens/s (prefill included), tau, ms
per step, the paired ratios cut / uncut and shared / per call, whether every output equals plain
decoding's, and the block costs the cut timed (median seconds per block size).

    python benchmarks/suffix_cut.py --dataset humaneval --limit 20 --out runs/suffix_cut_he.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

import torch

import runtime
from specdec.drafters.suffix import SuffixCache, SuffixConfig, SuffixDrafter
from specdec.evaluation.prompts import encode, eos_ids, load_prompts
from specdec.generate import generate
from specdec.tuning.costs import NodeCalibration
from specdec.tuning.warmup import compile_block_steps

VARIANTS = ("suffix", "suffix per call", "suffix uncut")


def drafters(target, caches: dict[str, SuffixCache], calibration: NodeCalibration) -> dict[str, SuffixDrafter]:
    """A new drafter per variant (`caches`: each variant's answers; `calibration`: the shared one's)."""
    return {"suffix": SuffixDrafter(SuffixConfig(), cache=caches["suffix"], target=target, calibration=calibration),
            "suffix per call": SuffixDrafter(SuffixConfig(), cache=caches["suffix per call"]),
            "suffix uncut": SuffixDrafter(SuffixConfig(cut=False), cache=caches["suffix uncut"])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--dataset", default="humaneval")
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--weights", default="gguf", choices=["gguf", "dense", "auto"])
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--out", type=Path, required=True, help="JSON of the per-prompt records and the summary")
    args = p.parse_args()
    torch.set_num_threads(2)
    tok = runtime.load_tokenizer(args.target)
    target = runtime.load_model(args.target, weights=args.weights, compile=not args.no_compile)
    eos = eos_ids(args.target, tok)
    rows = [(q.id, torch.tensor(encode(tok, [q.turns[0]], [], False)))
            for q in load_prompts(dataset=args.dataset, limit=args.limit)]
    compile_block_steps(target)
    caches = {name: SuffixCache() for name in VARIANTS}
    calibration = NodeCalibration()
    for name, drafter in drafters(target, caches, calibration).items():  # warm-up, untimed; caches emptied after
        generate(target, [rows[0][1]], draft=drafter, max_new_tokens=args.max_new_tokens, eos_token_id=eos)
        caches[name].clear()
    generate(target, [rows[0][1]], max_new_tokens=args.max_new_tokens, eos_token_id=eos)
    records, last = [], {}
    for i, (pid, ids) in enumerate(rows):
        plain = generate(target, [ids], max_new_tokens=args.max_new_tokens, eos_token_id=eos)
        rec = {"id": pid, "plain": plain.stats.to_dict()}
        made = drafters(target, caches, calibration)
        for name in VARIANTS[i % 3:] + VARIANTS[:i % 3]:  # which variant goes first rotates
            last[name] = made[name]
            out = generate(target, [ids], draft=made[name], max_new_tokens=args.max_new_tokens, eos_token_id=eos)
            rec[name] = {**out.stats.to_dict(), "matches_plain": torch.equal(out.sequences[0], plain.sequences[0])}
        records.append(rec)
        print(pid, {m: round(rec[m]["tokens_per_second"], 1) for m in ("plain", *VARIANTS)}, flush=True)
    summary = {}
    for m in ("plain", *VARIANTS):
        st = [r[m] for r in records]
        summary[m] = {"tok_s": statistics.median(s["tokens_per_second"] for s in st),
                      "tau": sum(s["generated_tokens"] for s in st) / sum(s["target_forwards"] for s in st),
                      "ms_per_step": 1e3 * statistics.median(
                          (s["wall_s"] - s["ttft_s"]) / max(s["target_forwards"] - 1, 1) for s in st),
                      "matches_plain": all(s.get("matches_plain", True) for s in st)}
        summary[m]["vs_plain"] = summary[m]["tok_s"] / summary["plain"]["tok_s"]
    for key, (a, b) in {"paired cut / uncut": ("suffix", "suffix uncut"),
                        "paired shared / per call": ("suffix", "suffix per call")}.items():
        summary[key] = math.exp(statistics.mean(
            math.log(r[a]["tokens_per_second"] / r[b]["tokens_per_second"]) for r in records))
    costs = last["suffix"].costs
    summary["cut block ms"] = {b: round(1e3 * costs.cost(b), 1) for b in costs.sizes()}
    args.out.write_text(json.dumps({"command": vars(args) | {"out": str(args.out)}, "summary": summary,
                                    "records": records}, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
