"""The `specdec` subcommands of distill: `medusa data|train|tree`, `eagle data|train`, `distill draft|recover`.

`register(subparsers)` adds them to the `specdec` CLI (specdec.cli.COMMAND_MODULES); each parser sets
`func(args) -> int`. Defaults are the library's: the training flags derive from the fields of the
method's config (`MedusaTrainConfig`, `EagleTrainConfig`, `DistillConfig`, `RecoverConfig`;
`distill.config_args`), and `medusa data` / `eagle data` take generate_selfdistill's. `eagle data`
is `medusa data` with an EAGLE-3 feature cache (--cache) in place of Medusa's hidden-state cache.
Pipelines add subcommands to `specdec distill` through `distill_subparsers(subparsers)`, which
creates the command once and returns its sub-parsers.

This module is command line, like specdec/cli.py (docs/architecture.md): `distill recover` reads
its training windows with quant.calibration_batches and writes the recovered model with
quant.save_compressed; the library modules of distill do not import quant.
"""

from __future__ import annotations

import argparse
import inspect
import json
import time
from pathlib import Path

import torch

import quant
import runtime
from distill.config_args import add_dataclass_args, dataclass_from_args, field_arg
from distill.data.code_prompts import STUB_CACHE
from distill.data.dataset_answers import cache_answer_states
from distill.data.features import (
    MANIFEST,
    EagleLayout,
    MedusaLayout,
    cache_eagle_states,
    cache_hidden_states,
    check_cache_dir,
    load_cached,
)
from distill.data.selfdistill import (
    RECORDS,
    check_chat_template,
    check_records_file,
    generate_selfdistill,
    read_records,
    sharegpt_prompts,
    stop_token_ids,
)
from distill.draft.onpolicy import heldout_prompts, training_prompts
from distill.draft.train import METRICS, DistillConfig, check_distill_dir, distill_draft
from distill.eagle.train import ANSWERS_CACHE_DIR, CACHE_DIR, EagleTrainConfig, read_metrics, train_eagle
from distill.eagle.train import check_train_dir as check_eagle_train_dir
from distill.medusa.train import MedusaTrainConfig, data_vocab, head_accuracy, train_medusa
from distill.medusa.train import check_train_dir as check_medusa_train_dir
from distill.recover.train import RecoverConfig, check_recover_dir, recover
from runtime.argtypes import (
    int_at_least,
    nonnegative_float,
    nonnegative_int,
    number_arg,
    positive_float,
    positive_int,
    seed_number,
)
from runtime.atomic import atomic_write_text
from runtime.errors import CheckpointError
from runtime.hardware import DTYPES, batch_dtype
from runtime.loading import read_hf_config, resolve
from runtime.output_paths import created_output
from specdec.drafters.medusa.heads import attach_medusa, choose_tree
from specdec.drafters.medusa.io import load_medusa, read_medusa_config, save_medusa
from specdec.drafters.medusa.tree import expected_length
from specdec.evaluation.prompts import encode, load_prompts
from specdec.tuning.tree_cost import cost_report, describe, measure_trees

MAX_MINUTES_HELP = "omit it for no limit"


def arg_dtype(name: str) -> torch.dtype:
    """--dtype as a torch dtype; "auto" is bf16 where it is native, else float32 (runtime.hardware)."""
    return batch_dtype() if name == "auto" else DTYPES[name]


def deadline_after(minutes: float | None) -> float | None:
    """The time.monotonic() deadline `minutes` from now (--max-minutes, a positive_float; None: no deadline)."""
    return time.monotonic() + 60 * minutes if minutes is not None else None


def checkpoint_arg(flag: str, name_or_path: str) -> Path:
    """The checkpoint directory that option `flag` names (runtime's resolve: a catalogue name, a
    directory, a .gguf file or a hub id), checked before anything loads: CheckpointError naming the
    flag when the path does not exist or is not a model checkpoint (no config.json), not a later
    error about what a non-checkpoint lacks (its tokenizer, say)."""
    try:
        ckpt = resolve(name_or_path)
    except CheckpointError as err:
        raise CheckpointError(f"{flag}: {err}") from err
    if not (ckpt / "config.json").is_file():
        raise CheckpointError(f"{flag}: {ckpt} is not a model checkpoint (it has no config.json); pass a checkpoint "
                              "directory, a .gguf file, a hub id or a catalogue name (specdec fetch --list)")
    return ckpt


def check_seq_len(seq_len: int, **models: str) -> None:
    """ValueError naming --seq-len and the model when `seq_len` is more than the positions of one of
    `models` (flag name without dashes -> name or path; its config's max_position_embeddings), read
    from config.json before any weights load."""
    for flag, name in models.items():
        limit = read_hf_config(checkpoint_arg(f"--{flag}", name)).max_position_embeddings
        if seq_len > limit:
            raise ValueError(f"--seq-len {seq_len} is more than the {limit} positions of --{flag} {name} "
                             f"(max_position_embeddings); pass --seq-len {limit} or less")


def training_records(path: str | Path, data_command: str) -> list[dict]:
    """The records of --data, a self-distillation jsonl (distill.data.selfdistill.read_records); ValueError
    naming --data when `path` does not exist, is not a file or holds no complete record."""
    path = Path(path)
    fix = f"run `specdec {data_command} --out {path}` first"
    if not path.exists():
        raise ValueError(f"--data: {path} does not exist; pass the {RECORDS} file, or {fix}")
    if not path.is_file():
        raise ValueError(f"--data: {path} is not a file; pass the {RECORDS} file (specdec {data_command} --out)")
    records = read_records(path)
    if not records:
        raise ValueError(f"--data: no records in {path}; {fix}")
    return records


def cmd_data(args: argparse.Namespace) -> int:
    check_records_file(args.out)  # bad output paths fail before the model loads
    if args.hidden_cache:
        check_cache_dir(args.hidden_cache, MedusaLayout)
    eagle_cache, eagle = getattr(args, "eagle_cache", None), None  # `eagle data --cache`
    if eagle_cache:
        eagle = EagleTrainConfig(aux_layers=args.aux_layers, heldout_every=args.heldout_every)  # checked here
        check_cache_dir(eagle_cache, EagleLayout)
    tok = runtime.load_tokenizer(args.model)
    check_chat_template(tok, args.model_flag)  # the prompts are chat turns: fail before the model loads
    model = runtime.load_model(args.model, dtype=arg_dtype(args.dtype), weights="dense")
    layers = eagle.layers(model.config.num_layers) if eagle is not None else None
    prompts = sharegpt_prompts(tok, split="calibration", limit=args.num_prompts,
                               max_prompt_tokens=args.max_prompt_tokens)
    n = generate_selfdistill(model, tok, args.out, prompts, max_new_tokens=args.max_new_tokens,
                             batch_size=args.batch_size, temperature=args.temperature, seed=args.seed,
                             deadline=deadline_after(args.max_minutes), hidden_cache=args.hidden_cache,
                             num_heads=args.num_heads, eagle_cache=eagle_cache, aux_layers=layers,
                             heldout_every=eagle.heldout_every if eagle is not None else 20)
    print(f"{n} records in {args.out}")
    return 0


def cmd_medusa_train(args: argparse.Namespace) -> int:
    from accelerate import PartialState  # heavy (accelerate): loaded when a command trains, not at CLI start

    deadline = deadline_after(args.max_minutes)
    cfg = dataclass_from_args(MedusaTrainConfig, args)  # checked before any loading
    out = check_medusa_train_dir(args.out)  # so are the output directories and the data
    cache_dir = check_cache_dir(args.hidden_cache or out / "hidden_cache", MedusaLayout)
    records = training_records(args.data, "medusa data")
    model = runtime.load_model(args.model, dtype=arg_dtype(args.dtype), weights="dense")
    state = PartialState(cpu=model.device.type == "cpu")
    # a run that ends before a result (the deadline came before the first cached record or training step)
    # leaves new directories as they were; cached records are kept for the same command to resume
    inside = cache_dir.resolve().parent == out.resolve()
    with created_output(out, own=(f"{cache_dir.name}/{MANIFEST}",) if inside else ()), \
            created_output(cache_dir, own=(MANIFEST,)):
        with state.main_process_first():  # under accelerate launch the main process caches, the others read
            cache_hidden_states(model, records, cache_dir, args.num_heads,
                                deadline=deadline if state.is_main_process else time.monotonic())
        heads = attach_medusa(model, num_heads=args.num_heads, num_layers=args.num_layers,
                              shared_lm_head=not args.separate_lm_heads)
        metrics = train_medusa(heads, cache_dir, out, cfg, deadline=deadline)
    print(json.dumps({k: metrics[k] for k in ("steps", "top1_accuracy", "expected_accepted_per_step")}))
    return 0


def cmd_tree(args: argparse.Namespace) -> int:
    if args.data_vocab and not args.data_dir:
        raise ValueError("--data-vocab needs --data-dir: the hidden-state cache the heads were trained on")
    read_medusa_config(args.heads)  # not a heads directory: fail before the model loads
    model = runtime.load_model(args.model, dtype=DTYPES[args.dtype], weights="dense")
    heads = load_medusa(args.heads, model, dtype=torch.float32)
    if args.data_vocab:
        heads.restrict_vocab(data_vocab(load_cached(args.data_dir, "train", heads.num_heads, hidden=False)[1]))
    if args.data_dir:
        hidden, targets = load_cached(args.data_dir, "heldout", heads.num_heads)
        table = head_accuracy(heads, hidden, targets)
    elif heads.config.head_accuracy:
        table = [list(r) for r in heads.config.head_accuracy]
    else:
        raise ValueError(f"{args.heads} stores no measured accuracy; pass --data-dir with cached "
                         "held-out hidden states")
    num_nodes = _pick_size(args, model, table) if args.num_nodes == "auto" else args.num_nodes
    paths = choose_tree(heads, table, num_nodes)
    save_medusa(heads, args.heads, overwrite=True)  # the heads read above, with their new tree
    print(f"tree of {len(paths)} nodes, expected accepted per step "
          f"{expected_length(paths, table):.3f}: {[list(p) for p in paths]}")
    return 0


def _pick_size(args: argparse.Namespace, model, table: list[list[float]]) -> int:
    """Time each of `args.sizes` on this machine (heads in the model's dtype, as decoding loads
    them) and return the size with the highest expected speed; writes HEADS/tree_cost.json."""
    tok = runtime.load_tokenizer(args.model)
    row = torch.tensor(encode(tok, [load_prompts(dataset=args.cost_dataset, limit=1)[0].turns[0]], [], False))
    plain, costs = measure_trees(model, load_medusa(args.heads, model), row, args.sizes, table)
    print(describe(plain, costs))
    report = {"model": args.model, "dtype": args.dtype, **cost_report(plain, costs)}
    atomic_write_text(Path(args.heads) / "tree_cost.json", json.dumps(report, indent=1))
    return report["chosen_nodes"]


def parse_sizes(value: str) -> list[int]:
    """argparse type of --sizes: comma-separated positive ints."""
    try:
        sizes = [int(x) for x in value.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--sizes takes comma-separated tree sizes like 1,4,8, "
                                         f"not {value!r}") from None
    if min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"--sizes must all be >= 1, got {value!r}")
    return sizes


def _int_at_least(value: str, low: int, name: str, alternative: str = "") -> int:
    """`value` as an int >= `low`, or an argparse error naming the option (and its `alternative`)."""
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{name} takes an integer >= {low}{alternative}, not {value!r}") from None
    if n < low:
        raise argparse.ArgumentTypeError(f"{name} must be >= {low}{alternative}, got {n}")
    return n


def parse_share(value: str) -> float:
    """argparse type for a fraction in [0, 1] (--function-share)."""
    try:
        share = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {value!r}") from None
    if not 0 <= share <= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {share:g}")
    return share


def parse_num_nodes(value: str) -> int | str:
    """argparse type of --num-nodes: a positive int or "auto"."""
    return value if value == "auto" else _int_at_least(value, 1, "--num-nodes", " (or 'auto')")


def add_data_args(p: argparse.ArgumentParser) -> None:
    """The options of a self-distillation data command (`medusa data`, `eagle data`) that `cmd_data`
    reads besides the model, its dtype, --hidden-cache and --num-heads; defaults are
    generate_selfdistill's and sharegpt_prompts'."""
    gen = {k: v.default for k, v in inspect.signature(generate_selfdistill).parameters.items()}
    pool = {k: v.default for k, v in inspect.signature(sharegpt_prompts).parameters.items()}
    p.add_argument("--out", required=True, help="jsonl file to append to (new, or one this command wrote: "
                   "another file is refused, never truncated)")
    p.add_argument("--num-prompts", type=positive_int, default=pool["limit"],
                   help="ShareGPT calibration conversations read for prompts (default: %(default)s)")
    p.add_argument("--max-prompt-tokens", type=positive_int, default=pool["max_prompt_tokens"],
                   help="longer opening turns are skipped (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=positive_int, default=gen["max_new_tokens"],
                   help="answer length cap (default: %(default)s)")
    p.add_argument("--batch-size", type=positive_int, default=gen["batch_size"],
                   help="prompts answered per batch (default: %(default)s)")
    p.add_argument("--temperature", type=nonnegative_float, default=gen["temperature"], help="0 = greedy answers")
    p.add_argument("--seed", type=seed_number, default=gen["seed"], help="seed of sampled answers")
    p.add_argument("--max-minutes", type=positive_float, default=None,
                   help=f"start no new batch after this many minutes (the same command resumes; {MAX_MINUTES_HELP})")


def _register_medusa(subparsers) -> None:
    """Add `medusa data|train|tree` to the `specdec` CLI."""
    gen = {k: v.default for k, v in inspect.signature(generate_selfdistill).parameters.items()}
    medusa = subparsers.add_parser("medusa", help="Medusa heads: self-distillation data, training, trees")
    sub = medusa.add_subparsers(dest="medusa_command", required=True)

    def common(p: argparse.ArgumentParser, batched: bool = False) -> None:
        p.add_argument("--model", required=True, help="catalogue name or checkpoint directory")
        if batched:  # many rows per product: float32 where bf16 is not native (runtime.hardware)
            p.add_argument("--dtype", default="auto", choices=["auto", *sorted(DTYPES)],
                           help="model dtype (default auto: bfloat16 where the hardware multiplies it "
                                "natively, float32 elsewhere, e.g. on AVX2-only CPUs, where batched bf16 "
                                "products run several times slower)")
        else:
            p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))

    d = sub.add_parser("data", help="the model's own answers to ShareGPT prompts (jsonl, resumable)")
    common(d, batched=True)
    add_data_args(d)
    d.add_argument("--hidden-cache", default=None,
                   help="also store the hidden states that generation computes in this directory, so "
                        "`specdec medusa train --hidden-cache DIR` skips its second pass over the answers")
    d.add_argument("--num-heads", type=positive_int, default=gen["num_heads"],
                   help="heads the --hidden-cache targets are for")
    d.set_defaults(func=cmd_data, model_flag="--model")

    t = sub.add_parser("train", help="cache hidden states, train heads (Medusa-1), pick their tree")
    common(t, batched=True)
    t.add_argument("--data", required=True, help="self-distillation jsonl (specdec medusa data)")
    t.add_argument("--out", required=True, help="directory for the heads (distill.load_medusa): new, empty, or "
                   "an earlier run's, which training resumes; a directory specdec did not write is refused")
    t.add_argument("--hidden-cache", default=None, help="default: OUT/hidden_cache")
    attach = {k: v.default for k, v in inspect.signature(attach_medusa).parameters.items()}
    t.add_argument("--num-heads", type=positive_int, default=attach["num_heads"],
                   help="Medusa heads: head i guesses token t+2+i (default: %(default)s)")
    t.add_argument("--num-layers", type=positive_int, default=attach["num_layers"],
                   help="residual blocks per head (default: %(default)s)")
    t.add_argument("--separate-lm-heads", action="store_true",
                   help="a trainable LM head per Medusa head instead of the shared frozen one")
    add_dataclass_args(t.add_argument_group("training (MedusaTrainConfig)"), MedusaTrainConfig)
    t.add_argument("--max-minutes", type=positive_float, default=None,
                   help="stop caching and training after this many minutes; the heads are still measured, "
                        f"given their tree and saved, and the same command resumes ({MAX_MINUTES_HELP})")
    t.set_defaults(func=cmd_medusa_train)

    r = sub.add_parser("tree", help="rebuild the heads' candidate tree from measured accuracy")
    common(r)
    r.add_argument("--heads", required=True, help="heads directory (rewritten in place)")
    r.add_argument("--num-nodes", type=parse_num_nodes, default=MedusaTrainConfig.tree_nodes,
                   help="tree size, or 'auto': time the trees of --sizes on this machine against plain "
                        "decoding and keep the one with the highest expected speed (expected tau / step "
                        "cost; on a CPU a small tree often wins); the timings go to HEADS/tree_cost.json")
    r.add_argument("--sizes", type=parse_sizes, default="1,2,4,8,12,16,24,32", help="tree sizes --num-nodes auto tries")
    r.add_argument("--cost-dataset", default="humaneval", choices=["humaneval", "sharegpt"],
                   help="dataset whose first prompt --num-nodes auto decodes for its timings")
    r.add_argument("--data-dir", default=None, help="hidden-state cache to measure accuracy on")
    r.add_argument("--data-vocab", action="store_true",
                   help="also restrict the heads' guesses to the tokens of the cache's training targets, as "
                        "training with --vocab data does (for heads saved without that restriction)")
    r.set_defaults(func=cmd_tree)


EAGLE_TRAIN_DESCRIPTION = """\
Train an EAGLE-3 draft head for TARGET on its own answers (--data, from `specdec eagle data`).

The target runs once over every record and the states entering three of its layers (low, middle,
high) and its final hidden states are cached on disk (OUT/eagle_cache or --cache; resumable).
The head (one decoder layer over the fused states and the next token's embedding, and an LM head
over the --draft-vocab-size most frequent answer tokens) then learns the target's next-token
distribution with training-time test: --ttt-steps unrolled steps, each later one reading the head's
own previous output, weighted --decay**s. OUT receives the head in the speculators format (what vLLM
loads; `specdec eval --methods eagle:OUT`, specdec.load_eagle), checkpoints (the same command
resumes), loss.png and metrics.json (per-depth held-out accuracy)."""


def cmd_eagle_train(args: argparse.Namespace) -> int:
    from accelerate import PartialState  # heavy (accelerate): loaded when a command trains, not at CLI start

    deadline = deadline_after(args.max_minutes)
    cfg = dataclass_from_args(EagleTrainConfig, args)  # checked before any loading
    out = check_eagle_train_dir(args.out)  # so are the output directories and the data
    cache_dir = check_cache_dir(args.cache or out / CACHE_DIR, EagleLayout)
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


def _register_eagle(subparsers) -> None:
    """Add `eagle data|train` to the `specdec` CLI."""
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
                       description=EAGLE_TRAIN_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    t.set_defaults(func=cmd_eagle_train)


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


def _register_distill(subparsers) -> None:
    """Add `distill draft` and `distill recover` to the `specdec` CLI."""
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
    from accelerate import PartialState  # heavy (accelerate): loaded when a command trains, not at CLI start

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


def register(subparsers) -> None:
    """Add `medusa`, `eagle` and `distill` with their subcommands to the `specdec` CLI."""
    _register_medusa(subparsers)
    _register_eagle(subparsers)
    _register_distill(subparsers)
