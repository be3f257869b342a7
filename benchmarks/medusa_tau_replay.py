"""Predict greedy Medusa tau for several tree sizes from one plain decoding pass.

Replays each tree over the plain greedy continuation and its hidden states (specdec.tuning.medusa_replay)
instead of running it: one ~3-minute plain pass for qwen2.5-coder-1.5b on 32 HumanEval problems
answers for every size, where a real tau run of one 256-node tree takes ~100 minutes on this CPU.
The trees are built from the heads' held-out accuracy table, as `specdec medusa tree` builds
them, never from the replayed prompts; the real run remains the figure BENCHMARKS.md reports.

    python benchmarks/medusa_tau_replay.py --heads runs/medusa_qwen15_t128 \
        --model qwen2.5-coder-1.5b-instruct --dataset humaneval --limit 32 --nodes 64,128,256,512
"""

from __future__ import annotations

import argparse
import json

import torch

import distill
import runtime
from distill.command import parse_sizes
from distill.data.selfdistill import stop_token_ids
from runtime.hardware import DTYPES
from specdec.drafters.medusa.tree import Tree, build_tree
from specdec.evaluation.prompts import encode, load_prompts
from specdec.tuning.medusa_replay import replay_tau


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", required=True, help="Medusa heads directory (with a held-out accuracy table)")
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--dataset", default="humaneval")
    p.add_argument("--limit", type=int, default=32, help="prompts (the recipe's tau uses the first 32)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--nodes", type=parse_sizes, default=[64, 128, 256], help="tree sizes, comma-separated")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--raw", action="store_true", help="prompts without the chat template")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = runtime.load_model(args.model, dtype=DTYPES[args.dtype], weights="dense")
    tok = runtime.load_tokenizer(args.model)
    heads = distill.load_medusa(args.heads, model)
    if heads.config.head_accuracy is None:
        raise SystemExit(f"{args.heads} stores no held-out accuracy table to build trees from; "
                         "rebuild its tree with `specdec medusa tree --data-dir`")
    table = [list(r) for r in heads.config.head_accuracy]
    rows = [torch.tensor(encode(tok, [q.turns[0]], [], args.raw))
            for q in load_prompts(dataset=args.dataset, limit=args.limit)]
    trees = {str(n): Tree(build_tree(table, n)) for n in args.nodes}
    counts = replay_tau(model, heads, rows, trees, args.max_new_tokens, stop_token_ids(tok))
    print(json.dumps({"heads": args.heads, "dataset": args.dataset, "prompts": len(rows), "dtype": args.dtype,
                      "max_new_tokens": args.max_new_tokens,
                      "trees": {n: c.to_dict() for n, c in counts.items()}}, indent=1))


if __name__ == "__main__":
    main()
