"""Recipe (b): an INT4-GPTQ copy of qwen2.5-coder-1.5b-instruct used as its own draft (self-speculation,
no training), then `specdec eval`: plain 1.5B vs 1.5B drafted by its INT4 copy.

    python recipes/quant_qwen15_int4_selfspec.py --n-calib 64 --n-eval 16 --eval-limit 20
"""

from __future__ import annotations

import torch
from quant_common import (
    check_outputs,
    compress_and_save,
    eval_windows,
    recipe_args,
    report,
    specdec_eval,
    write_summary,
)
from recipe_errors import run

import quant
import runtime
from specdec.methods import DrafterSpec

MODEL = "qwen2.5-coder-1.5b-instruct"


def main() -> None:
    # code calibration: on the 0.5B (not measured on the 1.5B) it is the one calibration measured at
    # or below NF4 on both chat and code perplexity (BENCHMARKS.md section 4)
    args = recipe_args(__doc__.splitlines()[0], calib_source="code")
    int4_dir, summary = args.out / "qwen2.5-coder-1.5b-int4-gptq", args.out / "qwen2.5-coder-1.5b-int4.json"
    check_outputs(args.out, [int4_dir], summary, args.overwrite)
    tok = runtime.load_tokenizer(MODEL)
    evals = eval_windows(tok, args.n_eval, args.seq_len)
    calib = quant.calibration_batches(tok, args.calib_source, n_samples=args.n_calib, seq_len=args.seq_len)
    rows = [report("dense-bf16", runtime.load_model(MODEL, dtype=torch.bfloat16, weights="dense"), evals, None, 0.0)]
    gptq = quant.Int4WeightOnly(group_size=128, method="gptq", act_order=True)
    rows.append(compress_and_save(MODEL, [gptq], calib, int4_dir, tok, evals, args.overwrite))
    write_summary(summary, rows)

    # ---- last step: self-speculation (specdec eval) ----
    if not args.skip_eval:
        methods = ["plain", str(DrafterSpec("draft", str(int4_dir)))]
        raise SystemExit(specdec_eval(MODEL, methods, args.out / "eval-qwen15-selfspec",
                                      args.eval_limit, args.max_new_tokens))


if __name__ == "__main__":
    run(main)
