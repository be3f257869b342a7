"""Recipe (a): INT8 and INT4-GPTQ drafts of qwen2.5-coder-0.5b-instruct, then `specdec eval` against the 1.5B.

    python recipes/quant_qwen05_drafts.py --n-calib 64 --n-eval 16 --eval-limit 20

1. calibration windows of site-packages Python (`--calib-source`); perplexity windows from the
   held-out ShareGPT slice and Python stdlib sources;
2. dense bf16 perplexity and size;
3. INT8 weight-only (per channel) -> OUT/qwen2.5-coder-0.5b-int8, perplexity and size;
4. INT4 GPTQ g128 -> OUT/qwen2.5-coder-0.5b-int4-gptq, perplexity and size;
5. (separate step, `--skip-eval` to leave out) `specdec eval` with the 1.5B target:
   draft:<bf16 0.5B> vs draft:<INT8> vs draft:<INT4>: tau and tokens/s.
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

MODEL, TARGET = "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"


def main() -> None:
    # code calibration: GPTQ of the 0.5B calibrated on code is the one calibration measured at or
    # below NF4 on both chat and code perplexity (BENCHMARKS.md section 4)
    args = recipe_args(__doc__.splitlines()[0], calib_source="code")
    int8_dir, int4_dir = args.out / "qwen2.5-coder-0.5b-int8", args.out / "qwen2.5-coder-0.5b-int4-gptq"
    summary = args.out / "qwen2.5-coder-0.5b-drafts.json"
    check_outputs(args.out, [int8_dir, int4_dir], summary, args.overwrite)
    tok = runtime.load_tokenizer(MODEL)
    evals = eval_windows(tok, args.n_eval, args.seq_len)
    calib = quant.calibration_batches(tok, args.calib_source, n_samples=args.n_calib, seq_len=args.seq_len)
    rows = [report("dense-bf16", runtime.load_model(MODEL, dtype=torch.bfloat16, weights="dense"), evals, None, 0.0)]
    rows.append(compress_and_save(MODEL, [quant.Int8WeightOnly()], None, int8_dir, tok, evals, args.overwrite))
    gptq = quant.Int4WeightOnly(group_size=128, method="gptq", act_order=True)
    rows.append(compress_and_save(MODEL, [gptq], calib, int4_dir, tok, evals, args.overwrite))
    write_summary(summary, rows)

    # ---- last step: end-to-end speculative decoding with the 1.5B target (specdec eval) ----
    if not args.skip_eval:
        methods = [str(DrafterSpec("draft", str(path))) for path in (MODEL, int8_dir, int4_dir)]
        raise SystemExit(specdec_eval(TARGET, methods, args.out / "eval-qwen05-drafts", args.eval_limit,
                                      args.max_new_tokens))


if __name__ == "__main__":
    run(main)
