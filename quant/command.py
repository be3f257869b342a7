"""`specdec compress`: apply a YAML recipe to a model, save the compressed checkpoint, print a summary table.

    specdec compress --model qwen2.5-coder-0.5b-instruct --recipe recipes/quant_int4_gptq.yaml --out DIR
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

import runtime
from runtime.argtypes import int_at_least, nonnegative_int, path_arg, positive_int
from runtime.hardware import DTYPES


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `compress` subcommand; its handler is set with set_defaults(func=run)."""
    p = subparsers.add_parser("compress", help="quantize / sparsify a model with a YAML recipe",
                              description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="catalogue name, checkpoint dir, .gguf file or hub id")
    p.add_argument("--recipe", required=True, type=path_arg,
                   help="YAML recipe (a list of configs, or steps + calibration)")
    p.add_argument("--out", required=True, type=path_arg,
                   help="output directory, new or empty (written atomically; a file or a directory specdec did "
                        "not write is refused)")
    p.add_argument("--export-dense", action="store_true",
                   help="also write a plain Hugging Face checkpoint (dequantized) to OUT-dense")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a compressed checkpoint (and OUT-dense export) already in OUT; nothing else is "
                        "ever replaced")
    p.add_argument("--calib-samples", type=positive_int, default=None,
                   help="override the recipe's calibration n_samples")
    p.add_argument("--seq-len", type=int_at_least(2), default=None,
                   help="override the recipe's calibration seq_len (also the perplexity windows' length)")
    p.add_argument("--eval-samples", type=nonnegative_int, default=8,
                   help="held-out ShareGPT windows scored before and after (0 = skip perplexity)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--device", default="cpu")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Handler of `specdec compress`; returns the exit code."""
    # heavy: the quant package takes over a second to import; it loads when the command runs, not at CLI start
    import quant
    from quant.checkpoint import check_compressed_out, check_export_out
    from quant.recipe import apply_recipe, load_recipe

    dense_out = Path(f"{args.out}-dense")
    check_compressed_out(args.out, args.overwrite)  # bad output paths fail before any work
    if args.export_dense:
        check_export_out(dense_out, args.overwrite)
    recipe = load_recipe(args.recipe)
    overrides = {"n_samples": args.calib_samples, "seq_len": args.seq_len}
    recipe = replace(recipe, calibration={**recipe.calibration,
                                          **{k: v for k, v in overrides.items() if v is not None}})  # checked again
    calib_args = recipe.calibration
    tok = runtime.load_tokenizer(args.model)
    model = runtime.load_model(args.model, dtype=DTYPES[args.dtype], device=args.device, weights="dense")
    limit = model.config.max_position_embeddings
    used = recipe.needs_calibration or args.eval_samples  # windows to calibrate on or to score
    if used and calib_args["seq_len"] > limit:  # checked before any of them is made
        given = "--seq-len" if args.seq_len is not None else f"the calibration seq_len of {args.recipe}"
        raise ValueError(f"{given} {calib_args['seq_len']} is more than the {limit} positions of --model {args.model} "
                         f"(max_position_embeddings); pass --seq-len {limit} or less")
    evals = (quant.eval_batches(tok, "sharegpt", n_samples=args.eval_samples, seq_len=calib_args["seq_len"])
             if args.eval_samples else None)
    ppl_before = quant.perplexity(model, evals, progress=True) if evals is not None else None
    bytes_before = quant.model_nbytes(model)
    t0 = time.perf_counter()
    calibration = quant.calibration_batches(tok, **calib_args) if recipe.needs_calibration else None
    apply_recipe(model, recipe, calibration)
    took = time.perf_counter() - t0
    out = quant.save_compressed(model, args.out, tokenizer=tok, overwrite=args.overwrite)
    ppl_after = quant.perplexity(model, evals, progress=True) if evals is not None else None
    rows = [("perplexity (held-out ShareGPT)", _fmt(ppl_before), _fmt(ppl_after)),
            ("weights in memory (MiB)", f"{bytes_before / 2**20:.1f}", f"{quant.model_nbytes(model) / 2**20:.1f}"),
            ("weights on disk (MiB)", "", f"{quant.dir_nbytes(out) / 2**20:.1f}"),
            ("time (s)", "", f"{took:.1f}")]
    print(f"\n| {args.model} | before | after |\n|---|---|---|")
    for name, before, after in rows:
        print(f"| {name} | {before} | {after} |")
    print(f"\ncompressed checkpoint: {out}")
    if args.export_dense:
        dense = quant.export_dense(model, dense_out, tokenizer=tok, overwrite=args.overwrite)
        print(f"dense export: {dense}")
    return 0


def _fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}"
