"""Perplexity / size table of one model under several compression configs (the quant section of BENCHMARKS.md).

Held-out ShareGPT windows and Python stdlib windows are scored for the dense model and for each
config (calibrated on the disjoint ShareGPT calibration slice, or with --calib-source on
site-packages code as well). Prints a markdown table and writes the rows as JSON.

    python recipes/quant_benchmark.py --model smollm2-135m-instruct --configs dense,int8,int4-rtn,int4-gptq,nf4 \
        --n-calib 32 --n-eval 16 --seq-len 512 --out runs/quant_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from quant_common import add_calib_source
from recipe_errors import run

import quant
import runtime
from runtime.argtypes import path_arg
from runtime.atomic import atomic_write_text
from runtime.hardware import DTYPES
from runtime.output_paths import check_output_file


def configs(group_size: int) -> dict[str, quant.config.Config]:
    """The named configs of the table (INT4 grids with `group_size` inputs per group)."""
    return {
        "int8": quant.Int8WeightOnly(),
        "int8-mixed": quant.Int8Mixed(),
        "int4-rtn": quant.Int4WeightOnly(group_size=group_size, method="rtn"),
        "int4-rtn-minmax": quant.Int4WeightOnly(group_size=group_size, method="rtn", grid="minmax"),
        "int4-gptq": quant.Int4WeightOnly(group_size=group_size, method="gptq"),
        "int4-gptq-mse": quant.Int4WeightOnly(group_size=group_size, method="gptq", grid="mse"),
        "int4-gptq-act": quant.Int4WeightOnly(group_size=group_size, method="gptq", act_order=True),
        "int4-gptq-act-hmse-d0.1": quant.Int4WeightOnly(group_size=group_size, method="gptq", act_order=True,
                                                        grid="hmse", damp=0.1),
        "int4-gptq-act-minmax": quant.Int4WeightOnly(group_size=group_size, method="gptq", act_order=True,
                                                     grid="minmax"),
        "nf4": quant.NF4(),
        "24-magnitude": quant.SemiStructured24(method="magnitude"),
        "24-wanda": quant.SemiStructured24(method="wanda"),
        "24-sparsegpt": quant.SemiStructured24(method="sparsegpt"),
        "24-sparsegpt-int4": quant.SemiStructured24(method="sparsegpt", int4_group_size=group_size),
        **({"nf4-g": quant.NF4(blocksize=group_size)} if group_size in quant.config.NF4_BLOCKSIZES else {}),
    }


def _is_benchmark_json(path: Path) -> bool:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and {"model", "rows"} <= set(data)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--configs", default="dense,int8,int4-rtn,int4-gptq,nf4",
                    help=f"comma list of dense and {', '.join(configs(128))}")
    ap.add_argument("--group-size", type=int, default=128, help="INT4 group size (must divide every input width)")
    ap.add_argument("--n-calib", type=int, default=32)
    add_calib_source(ap, "sharegpt")
    ap.add_argument("--n-eval", type=int, default=16)
    ap.add_argument("--windows", default="contiguous", choices=["contiguous", "per-text"],
                    help="calibration and evaluation windows: contiguous tokens of the texts in order (a few "
                         "long conversations / files), or each window from the start of its own text")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--out", type=path_arg, default=None)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 on a shared CPU)")
    args = ap.parse_args()
    names = args.configs.split(",")
    table = configs(args.group_size)
    unknown = [n for n in names if n != "dense" and n not in table]
    if unknown:
        raise SystemExit(f"unknown configs {unknown}; choose from dense, {', '.join(table)}")
    if args.out:  # a directory, or a file this recipe did not write, fails before any work
        check_output_file(args.out, what="quant benchmark JSON", looks_like=_is_benchmark_json)
    dtype = DTYPES[args.dtype]
    torch.set_num_threads(args.threads)
    tok = runtime.load_tokenizer(args.model)
    per_text = args.windows == "per-text"
    calib = quant.calibration_batches(tok, args.calib_source, n_samples=args.n_calib, seq_len=args.seq_len,
                                      one_per_text=per_text)
    evals = {src: quant.eval_batches(tok, src, n_samples=args.n_eval, seq_len=args.seq_len, one_per_text=per_text)
             for src in ("sharegpt", "stdlib")}
    rows = []
    for name in names:
        model = runtime.load_model(args.model, dtype=dtype, weights="dense")
        t0 = time.perf_counter()
        if name != "dense":
            cfg = table[name]
            verb = quant.sparsify_ if isinstance(cfg, quant.SemiStructured24) else quant.quantize_
            verb(model, cfg, calibration=calib)
        took = time.perf_counter() - t0
        row = {"config": name, "compress_s": round(took, 1), "bytes": quant.model_nbytes(model)}
        for src, batches in evals.items():
            row[f"ppl_{src}"] = round(quant.perplexity(model, batches, progress=True), 4)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            atomic_write_text(args.out, json.dumps({"model": args.model, "dtype": args.dtype, "n_calib": args.n_calib,
                                                    "calib_source": args.calib_source, "windows": args.windows,
                                                    "group_size": args.group_size, "n_eval": args.n_eval,
                                                    "seq_len": args.seq_len, "rows": rows}, indent=1))
    print("\n| config | ppl ShareGPT held-out | ppl stdlib | MiB in memory | compress s |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['ppl_sharegpt']:.3f} | {r['ppl_stdlib']:.3f} | {r['bytes'] / 2**20:.1f} | "
              f"{r['compress_s']} |")


if __name__ == "__main__":
    run(main)
