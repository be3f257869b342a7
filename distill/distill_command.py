"""`specdec distill ...`: distillation pipelines. `distill draft` runs distill.distill_draft (DistillSpec).

`register(subparsers)` adds the `distill` command to the `specdec` CLI with its `draft` and
`recover` (distill.recover_command) subcommands. Pipelines add their subcommands to the same
parser through `distill_subparsers(subparsers)`, which creates the `distill` command once and
returns its sub-parsers. `distill draft` derives its training flags from the fields of `DistillConfig`
(distill.config_args), so its defaults are the function's.
"""

from __future__ import annotations

import argparse
import json

from runtime.argtypes import nonnegative_int, number_arg, positive_float, positive_int
from runtime.hardware import DTYPES

DRAFT_DESCRIPTION = """\
Distil DRAFT toward TARGET (DistillSpec): the draft generates answers to chat and code prompts
(--data on-policy; or the target's answers, or a mix), the target scores every answer token once,
and the draft is trained to match it under --divergence (fkl, rkl, jsd with --beta, tvd) at
--temperature. Prompts: ShareGPT calibration conversations and function stubs cut from this
machine's Python sources (--code-share); held-out acceptance is measured every --eval-every steps
on the last --heldout-prompts prompts of ShareGPT's held-out slice: the draft's top-1 agreement
with the target's greedy answers (teacher-forced: greedy decoding's per-token acceptance, no
sampling noise) and, unless --no-eval-decode, tau by greedy speculative decoding. OUT receives
the distilled draft as a Hugging Face checkpoint (`specdec eval --methods draft:OUT`,
`runtime.load_model(OUT)`; `quant` compresses it), checkpoints (the same command resumes),
distill.png and distill_metrics.json.
Several processes: `accelerate launch --num_processes N -m specdec.cli distill draft ...`."""


def distill_subparsers(subparsers) -> argparse._SubParsersAction:
    """The sub-parsers of the `specdec distill` command, creating the command on first use; each
    distillation pipeline adds its subcommand here (`distill_subparsers(sub).add_parser("recover")`)."""
    parser = subparsers.choices.get("distill")
    if parser is None:
        parser = subparsers.add_parser("distill", help="distillation: align a draft to its target (draft), recover "
                                                       "a compressed model (recover)",
                                       description="Distillation pipelines (`specdec distill SUBCOMMAND --help`).")
        parser.subcommands = parser.add_subparsers(dest="distill_command", required=True, metavar="SUBCOMMAND")
    return parser.subcommands


def cmd_draft(args: argparse.Namespace) -> int:
    import torch

    import runtime
    from distill.code_prompts import STUB_CACHE
    from distill.command import arg_dtype, checkpoint_arg, deadline_after
    from distill.config_args import dataclass_from_args
    from distill.draft import METRICS, DistillConfig, check_distill_dir, distill_draft
    from distill.onpolicy import heldout_prompts, training_prompts
    from distill.selfdistill import check_chat_template, stop_token_ids

    deadline = deadline_after(args.max_minutes)
    cfg = dataclass_from_args(DistillConfig, args)  # checked before any loading
    for flag, name in (("--target", args.target), ("--draft", args.draft)):  # so are the models' paths
        checkpoint_arg(flag, name)
    out = check_distill_dir(args.out)  # and the output directory
    tok = runtime.load_tokenizer(args.draft)
    check_chat_template(tok, "--draft")  # the prompts are chat turns
    prompts = training_prompts(tok, args.num_prompts, args.max_prompt_tokens, args.code_share,
                               stub_cache=out / STUB_CACHE if args.code_share > 0 else None)
    held = heldout_prompts(tok, args.heldout_prompts, args.max_prompt_tokens)
    target = runtime.load_model(args.target, dtype=arg_dtype(args.dtype), weights="dense")
    # trained in float32 under --mixed-precision
    draft = runtime.load_model(args.draft, dtype=torch.float32, weights="dense")
    distill_draft(target, draft, prompts, cfg, out, heldout=held, tokenizer=tok, eos_token_id=stop_token_ids(tok),
                  deadline=deadline)
    metrics = json.loads((out / METRICS).read_text())
    evals = metrics["heldout"]
    first, last = (evals[0], evals[-1]) if evals else ({}, {})
    print(json.dumps({"steps": metrics["steps"], "planned_steps": metrics["planned_steps"],
                      "final_loss": metrics["final_loss"], "heldout_agreement_first": first.get("agreement"),
                      "heldout_agreement_last": last.get("agreement"), "heldout_tau_first": first.get("tau"),
                      "heldout_tau_last": last.get("tau"), "draft": str(out)}))
    return 0


def _share(value: float) -> None:
    """The check of --code-share: a fraction in [0, 1)."""
    if not 0 <= value < 1:
        raise ValueError(f"must be in [0, 1), got {value:g}")


def add_prompt_args(p: argparse.ArgumentParser) -> None:
    """The prompt options of draft distillation (shared with recipes/distill_qwen05_draft.py)."""
    p.add_argument("--num-prompts", type=positive_int, default=2000,
                   help="ShareGPT calibration conversations read for chat prompts (default: %(default)s)")
    p.add_argument("--code-share", type=number_arg(float, _share), default=0.25,
                   help="share of the prompts that are function stubs from this machine's Python sources "
                        "(HumanEval-shaped; 0 = ShareGPT only; default: %(default)s)")
    p.add_argument("--max-prompt-tokens", type=positive_int, default=256,
                   help="longest prompt kept (default: %(default)s)")
    p.add_argument("--heldout-prompts", type=nonnegative_int, default=8,
                   help="held-out ShareGPT prompts for the acceptance measurement (0 = none; default: %(default)s)")


def register(subparsers) -> None:
    """Add `distill draft` and `distill recover` (distill.recover_command) to the `specdec` CLI."""
    from distill.command import MAX_MINUTES_HELP
    from distill.config_args import add_dataclass_args
    from distill.draft import DistillConfig
    from distill.recover_command import add_recover_parser

    sub = distill_subparsers(subparsers)
    d = sub.add_parser(
        "draft", help="DistillSpec: distil a draft model toward its target (on-policy KD)",
        description=DRAFT_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    d.add_argument("--target", required=True, help="the target: catalogue name or checkpoint directory")
    d.add_argument("--draft", required=True, help="the draft to distil: catalogue name or checkpoint directory "
                   "(trained in float32; its tokenizer is saved with the result)")
    d.add_argument("--out", required=True, help="directory for the distilled draft, checkpoints and reports: new, "
                   "empty, or an earlier run's, which is resumed; a directory specdec did not write is refused")
    d.add_argument("--dtype", default="auto", choices=["auto", *sorted(DTYPES)],
                   help="target dtype (default auto: bfloat16 where the hardware multiplies it natively, float32 "
                        "elsewhere)")
    add_prompt_args(d)
    add_dataclass_args(d.add_argument_group("distillation (DistillConfig)"), DistillConfig)
    d.add_argument("--max-minutes", type=positive_float, default=None,
                   help="stop training after this many minutes; the draft is still saved, and the same command "
                        f"resumes ({MAX_MINUTES_HELP})")
    d.set_defaults(func=cmd_draft)
    add_recover_parser(sub)
