"""`specdec eagle ...` subcommands: data (the target's own answers) and train (feature cache + EAGLE-3 training).

`register(subparsers)` adds them to the `specdec` CLI; each parser sets `func(args) -> int`.
`eagle data` is `medusa data` (distill.command.cmd_data) with an EAGLE-3 feature cache (--cache) in
place of Medusa's hidden-state cache;
`eagle train` derives its training flags from the fields of `EagleTrainConfig` (distill.config_args).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from distill.command import MAX_MINUTES_HELP, add_data_args, arg_dtype, cmd_data, deadline_after, training_records
from runtime.argtypes import nonnegative_int, positive_float, positive_int
from runtime.hardware import DTYPES

TRAIN_DESCRIPTION = """\
Train an EAGLE-3 draft head for TARGET on its own answers (--data, from `specdec eagle data`).

The target runs once over every record and the states entering three of its layers (low, middle,
high) and its final hidden states are cached on disk (OUT/eagle_cache or --cache; resumable).
The head (one decoder layer over the fused states and the next token's embedding, and an LM head
over the --draft-vocab-size most frequent answer tokens) then learns the target's next-token
distribution with training-time test: --ttt-steps unrolled steps, each later one reading the head's
own previous output, weighted --decay**s. OUT receives the head in the speculators format (what vLLM
loads; `specdec eval --methods eagle:OUT`, specdec.load_eagle), checkpoints (the same command
resumes), loss.png and metrics.json (per-depth held-out accuracy)."""


def cmd_train(args: argparse.Namespace) -> int:
    from accelerate import PartialState

    import runtime
    from distill.config_args import dataclass_from_args
    from distill.dataset_answers import cache_answer_states
    from distill.eagle_cache import MANIFEST, cache_eagle_states, check_eagle_cache_dir
    from distill.train_eagle import (
        ANSWERS_CACHE_DIR,
        CACHE_DIR,
        EagleTrainConfig,
        check_train_dir,
        read_metrics,
        train_eagle,
    )
    from runtime.outputs import created_output

    deadline = deadline_after(args.max_minutes)
    cfg = dataclass_from_args(EagleTrainConfig, args)  # checked before any loading
    out = check_train_dir(args.out)  # so are the output directories and the data
    cache_dir = check_eagle_cache_dir(args.cache or out / CACHE_DIR)
    records = training_records(args.data, "eagle data")
    target = runtime.load_model(args.target, dtype=arg_dtype(args.dtype), weights="dense")
    state = PartialState(cpu=target.device.type == "cpu")
    # a run that fails before it cached a record (or checkpointed) leaves new directories as they were:
    # an empty cache (the deadline came first) is no result
    with created_output(out, own=(f"{CACHE_DIR}/{MANIFEST}", f"{ANSWERS_CACHE_DIR}/{MANIFEST}")), \
            created_output(cache_dir, own=(MANIFEST,)):
        with state.main_process_first():  # under accelerate launch the main process caches, the others read
            caches = [cache_eagle_states(target, records, cache_dir, cfg.layers(target.config.num_layers),
                                         heldout_every=cfg.heldout_every,
                                         deadline=deadline if state.is_main_process else time.monotonic())]
            if args.dataset_answers:  # ShareGPT's own answers, read teacher-forced, trained on beside the target's
                caches.append(cache_answer_states(target, runtime.load_tokenizer(args.target),
                                                  out / ANSWERS_CACHE_DIR, cfg.layers(target.config.num_layers),
                                                  args.dataset_answers, args.dataset_answer_tokens,
                                                  deadline=deadline if state.is_main_process else time.monotonic()))
        train_eagle(target, caches, cfg, out, deadline=deadline)
    metrics = read_metrics(out)
    held = metrics["heldout"] or {}
    print(json.dumps({"steps": metrics["steps"], "planned_steps": metrics["planned_steps"],
                      "heldout_accuracy_per_step": held.get("accuracy_per_step"), "head": str(Path(out))}))
    return 0


def _target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", dest="model", metavar="TARGET", required=True,
                   help="the target: catalogue name or checkpoint directory")
    p.add_argument("--dtype", default="auto", choices=["auto", *sorted(DTYPES)],
                   help="target dtype (default auto: bfloat16 where the hardware multiplies it natively, float32 "
                        "elsewhere, e.g. on AVX2-only CPUs)")


def register(subparsers) -> None:
    """Add `eagle data|train` to the `specdec` CLI."""
    from distill.config_args import add_dataclass_args, field_arg
    from distill.train_eagle import EagleTrainConfig

    eagle = subparsers.add_parser("eagle", help="EAGLE-3 draft heads: self-distillation data, training",
                                  description="EAGLE-3 draft heads (Li et al. 2025) for a runtime target.")
    sub = eagle.add_subparsers(dest="eagle_command", required=True)

    d = sub.add_parser("data", help="the target's own answers to ShareGPT prompts (jsonl, resumable)",
                       description="Append the target's answers to ShareGPT calibration prompts to a jsonl file "
                                   "(the records `specdec eagle train --data` reads; the same file as "
                                   "`specdec medusa data` writes). With --cache, the target's aux-layer and final "
                                   "states are stored from the same forwards, so `eagle train --cache` needs no second "
                                   "pass. "
                                   "The same command resumes.")
    _target_args(d)
    add_data_args(d)
    defaults = EagleTrainConfig()
    d.add_argument("--cache", dest="eagle_cache", default=None,
                   help="EAGLE-3 feature cache directory that receives the target's aux-layer and final states from "
                        "the generation's own forwards (pass it as `eagle train --cache`: training then needs no "
                        "second pass over the answers)")
    d.add_argument("--aux-layers", type=field_arg(EagleTrainConfig, "aux_layers"), default=defaults.aux_layers,
                   help="with --cache: the three target layers to store, e.g. 2,14,25 (empty: 2, L // 2, L - 3)")
    d.add_argument("--heldout-every", type=field_arg(EagleTrainConfig, "heldout_every"),
                   default=defaults.heldout_every,
                   help="with --cache: every N-th record goes to the held-out split (as `eagle train` expects)")
    d.set_defaults(func=cmd_data, hidden_cache=None, num_heads=1, model_flag="--target")

    t = sub.add_parser("train", help="cache the target's features, train an EAGLE-3 head (training-time test)",
                       description=TRAIN_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("--target", dest="target", required=True, help="the target: catalogue name or checkpoint directory")
    t.add_argument("--dtype", default="auto", choices=["auto", *sorted(DTYPES)],
                   help="target dtype (default auto: bfloat16 where the hardware multiplies it natively, float32 "
                        "elsewhere); the head trains in float32 under --mixed-precision")
    t.add_argument("--data", required=True, help="self-distillation jsonl (specdec eagle data)")
    t.add_argument("--out", required=True, help="directory for the head, checkpoints and reports: new, empty, or an "
                   "earlier run's, which training resumes; a directory specdec did not write is refused")
    t.add_argument("--cache", default=None, help="feature cache directory (default: OUT/eagle_cache)")
    t.add_argument("--dataset-answers", type=nonnegative_int, default=0, metavar="N",
                   help="also train on ShareGPT's own answers to N calibration conversations, read teacher-forced "
                        "by the target (about twice the positions per minute of generating answers; features in "
                        "OUT/eagle_cache_answers, resumable; caching counts against --max-minutes); held-out accuracy "
                        "stays on --data's answers (default 0: none)")
    t.add_argument("--dataset-answer-tokens", type=positive_int, default=256,
                   help="length cap of a ShareGPT answer")
    add_dataclass_args(t.add_argument_group("training (EagleTrainConfig)"), EagleTrainConfig)
    t.add_argument("--max-minutes", type=positive_float, default=None,
                   help="stop caching and training after this many minutes; the head is still evaluated and "
                        f"saved, and the same command resumes ({MAX_MINUTES_HELP})")
    t.set_defaults(func=cmd_train)
