"""`specdec distill recover`: recover a 2:4-sparse model by distillation from its dense original.

`add_recover_parser(distill_subparsers)` adds the `recover` subcommand to the sub-parsers of the
`specdec distill` command (distill.distill_command.distill_subparsers); its parser sets
`func(args) -> int`. The training flags derive from the fields of `RecoverConfig`
(distill.config_args), so the command's defaults are the function's. Writing the recovered model as
a compressed checkpoint is quant's (quant.save_compressed), imported when the command runs: like
specdec/cli.py, a command wires the packages together.
"""

from __future__ import annotations

import argparse
import json

from runtime.argtypes import int_at_least, positive_float, positive_int
from runtime.hardware import DTYPES

RECOVER_DESCRIPTION = """\
Recover STUDENT, a 2:4-sparse compressed checkpoint (quant.sparsify_ + quant.save_compressed, or
`specdec compress`), by distillation from TEACHER, the dense model it was pruned from. Training
windows come from the calibration slice of --data (ShareGPT, code or both); --heldout windows of
the held-out ShareGPT slice and of Python stdlib sources, never trained on, give the perplexity
followed during training and reported at the end. Only the kept weights (and the norms) train, so
the result is exactly 2:4 with the student's own mask. OUT receives the recovered model as a
compressed checkpoint in OUT/model (runtime.load_model(OUT/model)), checkpoints (the same command
resumes), recovery.png and metrics.json.
Several processes: `accelerate launch --num_processes N -m specdec.cli distill recover ...`."""


def cmd_recover(args: argparse.Namespace) -> int:
    import torch
    from accelerate import PartialState

    import quant
    import runtime
    from distill.command import arg_dtype, check_seq_len, deadline_after
    from distill.config_args import dataclass_from_args
    from distill.recover import RecoverConfig, check_recover_dir, recover

    deadline = deadline_after(args.max_minutes)
    cfg = dataclass_from_args(RecoverConfig, args)  # checked before any loading
    out = check_recover_dir(args.out)  # so is the output directory
    check_seq_len(args.seq_len, teacher=args.teacher, student=args.student)  # and the windows' length
    tok = runtime.load_tokenizer(args.teacher)
    train = quant.calibration_batches(tok, args.data, n_samples=args.n_train, seq_len=args.seq_len)  # (N, T)
    half = max(1, args.heldout // 2)
    held = torch.cat([quant.eval_batches(tok, src, n_samples=n, seq_len=args.seq_len)
                      for src, n in (("sharegpt", args.heldout - half), ("stdlib", half)) if n])  # (M, T)
    teacher = runtime.load_model(args.teacher, dtype=arg_dtype(args.dtype), weights="dense")
    student = runtime.load_model(args.student, dtype=arg_dtype(args.dtype), weights="dense")
    metrics = recover(student, teacher, train, cfg, out, heldout=held, deadline=deadline)
    if PartialState().is_main_process:
        quant.save_compressed(student, out / "model", tokenizer=tok, overwrite=True)
        evals = metrics["evals"]
        print(json.dumps({"steps": metrics["steps"], "planned_steps": metrics["planned_steps"],
                          "heldout_perplexity_first": evals[0]["perplexity"] if evals else None,
                          "heldout_perplexity_last": evals[-1]["perplexity"] if evals else None,
                          "model": str(out / "model")}))
    return 0


def add_recover_parser(distill_subparsers) -> argparse.ArgumentParser:
    """Add `recover` to the sub-parsers of `specdec distill`; returns its parser."""
    from distill.config_args import add_dataclass_args
    from distill.recover import RecoverConfig

    p = distill_subparsers.add_parser(
        "recover", help="recover a 2:4-sparse model by distillation from its dense original (keeps the mask)",
        description=RECOVER_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--student", required=True, help="the 2:4-sparse compressed checkpoint directory to recover")
    p.add_argument("--teacher", required=True, help="the dense model: catalogue name or checkpoint directory")
    p.add_argument("--out", required=True, help="directory for the recovered model, checkpoints and reports: new, "
                   "empty, or an earlier run's, which training resumes; a directory specdec did not write is refused")
    p.add_argument("--data", default="sharegpt+code", help="training text: sharegpt, code, sharegpt+code or a jsonl "
                   "path (quant.calibration_batches; default: %(default)s)")
    p.add_argument("--n-train", type=positive_int, default=2048, help="training windows (default: %(default)s)")
    p.add_argument("--seq-len", type=int_at_least(2), default=256, help="tokens per window (default: %(default)s)")
    p.add_argument("--heldout", type=positive_int, default=4,
                   help="held-out perplexity windows, half ShareGPT half code (default: %(default)s)")
    p.add_argument("--dtype", default="auto", choices=["auto", *sorted(DTYPES)],
                   help="dtype of the teacher and of the saved student (default auto: bfloat16 where the hardware "
                        "multiplies it natively, else float32); the student trains in float32 under --mixed-precision")
    add_dataclass_args(p.add_argument_group("training (RecoverConfig)"), RecoverConfig)
    p.add_argument("--max-minutes", type=positive_float, default=None,
                   help="stop training after this many minutes; the model is still evaluated and saved, and the same "
                        "command resumes")
    p.set_defaults(func=cmd_recover)
    return p
