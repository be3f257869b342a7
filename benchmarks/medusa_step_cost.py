"""What one Medusa tree step costs against one plain decoding step, by tree size.

    python benchmarks/medusa_step_cost.py --model qwen2.5-coder-1.5b-instruct --nodes 1,8,16,24,32,48,64

Speed with Medusa is tau / (tree step / plain step), so this ratio says which tree can pay off:
on a CPU a tree forward of N tokens is not free as it is on a GPU. Heads are attached untrained
(the step's cost does not depend on what they guess), one HumanEval chat prompt, batch 1, eager
(or `--compile`, optionally `--max-autotune`), best of `--repeats` runs per size. `--guess-vocab V`
restricts the heads' guesses to V token ids (as trained heads are, `MedusaHeads.restrict_vocab`).
`--heads DIR` times trained heads instead (their own guess vocabulary), builds each size's tree
from their held-out accuracy table and adds the expected tau (1 + expected accepted tokens per
step) and expected speed (tau / step cost), so it says which tree size pays on this machine
(`specdec medusa tree --num-nodes auto` measures the same and sets the best size).
`--compile` times compiled steps instead (`runtime.compile_decode`: the plain step and every
tree size as its own program, each holding a frozen weight copy for the life of the process, the
1.5B +3.1 GB per size: pass a few sizes per run).
Prints one line per size and writes `--json`.
"""

from __future__ import annotations

import argparse
import json

import torch

import distill
import runtime
from runtime.atomic import atomic_write_text
from runtime.hardware import DTYPES
from specdec.drafters.medusa.heads import default_tree
from specdec.drafters.medusa.tree import build_tree, expected_length
from specdec.evaluation.prompts import encode, load_prompts
from specdec.tuning.tree_cost import step_seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--nodes", default="1,8,16,24,32,48,64", help="tree sizes (comma-separated)")
    ap.add_argument("--guess-vocab", type=int, default=0, help="restrict guesses to this many ids (0 = all)")
    ap.add_argument("--heads", default=None,
                    help="trained heads directory: time them and add expected tau and speed per tree size")
    ap.add_argument("--tokens", type=int, default=24, help="tokens generated per timing")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument("--compile", action="store_true",
                    help="time compiled steps (runtime.compile_decode; +1 weight copy per tree size)")
    ap.add_argument("--max-autotune", action="store_true",
                    help="with --compile: let Inductor also try its own GEMM kernels and keep the fastest per "
                         "shape (on an AVX2-only CPU its small-row products cost far less per extra row)")
    args = ap.parse_args()

    dtype = DTYPES[args.dtype]
    if args.max_autotune and not args.compile:
        ap.error("--max-autotune needs --compile")
    model = runtime.load_model(args.model, dtype=dtype, weights="dense")
    if args.compile:
        runtime.compile_decode(model, max_autotune=args.max_autotune or None)
    tok = runtime.load_tokenizer(args.model)
    row = torch.tensor(encode(tok, [load_prompts(dataset="humaneval", limit=1)[0].turns[0]], [], False))
    heads = distill.load_medusa(args.heads, model) if args.heads else distill.attach_medusa(model, num_heads=4)
    table = [list(r) for r in heads.config.head_accuracy or ()] if args.heads else None
    if args.heads and not table:
        raise SystemExit(f"{args.heads} stores no measured accuracy: rebuild its tree with "
                         "`specdec medusa tree --data-dir CACHE` first")
    if args.guess_vocab:
        heads.restrict_vocab(torch.arange(args.guess_vocab))
    step_seconds(model, row, 4)  # warm-up
    plain = min(step_seconds(model, row, args.tokens)[0] for _ in range(args.repeats))
    print(f"{args.model} {args.dtype}, prompt {len(row)} tokens: plain step {plain * 1e3:.0f} ms", flush=True)
    rows = []
    for n in (int(x) for x in args.nodes.split(",")):
        tree = build_tree(table, n) if table else default_tree(heads.num_heads, n)
        heads.set_tree(tree)
        if args.compile:
            step_seconds(model, row, 4, heads)  # compiles this tree size's program
        step, in_heads = min(step_seconds(model, row, args.tokens, heads) for _ in range(args.repeats))
        row_out = {"nodes": n, "step_ms": step * 1e3, "heads_ms": in_heads * 1e3, "vs_plain": step / plain}
        line = (f"tree {n:3d} nodes: step {step * 1e3:.0f} ms = {step / plain:.2f}x plain "
                f"(heads {in_heads * 1e3:.1f} ms)")
        if table:
            tau = 1 + expected_length(tree, table)
            row_out.update(expected_tau=tau, expected_speedup=tau * plain / step)
            line += f", expected tau {tau:.2f}, expected speed {tau * plain / step:.2f}x plain"
        rows.append(row_out)
        print(line, flush=True)
    if args.json:
        atomic_write_text(args.json, json.dumps({"model": args.model, "dtype": args.dtype, "compiled": args.compile,
                                                 "max_autotune": args.max_autotune,
                                                 "threads": torch.get_num_threads(),
                                                 "guess_vocab": args.guess_vocab, "heads": args.heads,
                                                 "plain_step_ms": plain * 1e3,
                                                 "trees": rows}, indent=1))


if __name__ == "__main__":
    main()
