"""Recipe (c): 2:4 SparseGPT of smollm2-135m-instruct (magnitude and Wanda alongside for comparison).

    python recipes/compress_smollm2_24.py --n-calib 32 --n-eval 16

SmolLM2's width 576 is not a multiple of 128, so `--int4` (2:4 then INT4 of the survivors) uses groups of 64.
"""

from __future__ import annotations

import argparse

import torch
from quant_common import (
    add_calib_source,
    add_overwrite,
    check_outputs,
    compress_and_save,
    compressed_home,
    eval_windows,
    report,
    write_summary,
)
from recipe_errors import run

import quant
import runtime
from runtime.argtypes import path_arg

MODEL = "smollm2-135m-instruct"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=path_arg, default=compressed_home())
    add_calib_source(ap, "sharegpt")
    ap.add_argument("--n-calib", type=int, default=32)
    ap.add_argument("--n-eval", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--methods", default="magnitude,wanda,sparsegpt")
    ap.add_argument("--int4", action="store_true", help="also SparseGPT 2:4 + INT4 g64 of the kept weights")
    add_overwrite(ap)
    args = ap.parse_args()
    configs = [(f"smollm2-135m-24-{m}", quant.SemiStructured24(method=m)) for m in args.methods.split(",")]
    if args.int4:
        configs.append(("smollm2-135m-24-sparsegpt-int4", quant.SemiStructured24(method="sparsegpt",
                                                                                 int4_group_size=64)))
    summary = args.out / "smollm2-135m-24.json"
    check_outputs(args.out, [args.out / name for name, _ in configs], summary, args.overwrite)
    tok = runtime.load_tokenizer(MODEL)
    evals = eval_windows(tok, args.n_eval, args.seq_len)
    calib = quant.calibration_batches(tok, args.calib_source, n_samples=args.n_calib, seq_len=args.seq_len)
    rows = [report("dense-bf16", runtime.load_model(MODEL, dtype=torch.bfloat16, weights="dense"), evals, None, 0.0)]
    for name, cfg in configs:
        rows.append(compress_and_save(MODEL, [cfg], calib if cfg.needs_calibration else None, args.out / name,
                                      tok, evals, args.overwrite))
    write_summary(summary, rows)


if __name__ == "__main__":
    run(main)
