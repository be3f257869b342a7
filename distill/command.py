"""`specdec medusa ...` subcommands: data (self-distillation), train (cache + train), tree.

`register(subparsers)` adds them to the `specdec` CLI; each parser sets `func(args) -> int`.
Defaults are the library's: `medusa train` derives its training flags from the fields of
`MedusaTrainConfig` (`distill.config_args`), and `medusa data` takes generate_selfdistill's.
"""

from __future__ import annotations

import argparse
import inspect
import json
import time
from pathlib import Path

import torch

from runtime.argtypes import nonnegative_float, positive_float, positive_int, seed_number
from runtime.hardware import DTYPES, batch_dtype

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
    from runtime.errors import CheckpointError
    from runtime.loading import resolve

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
    from runtime.loading import read_hf_config

    for flag, name in models.items():
        limit = read_hf_config(checkpoint_arg(f"--{flag}", name)).max_position_embeddings
        if seq_len > limit:
            raise ValueError(f"--seq-len {seq_len} is more than the {limit} positions of --{flag} {name} "
                             f"(max_position_embeddings); pass --seq-len {limit} or less")


def training_records(path: str | Path, data_command: str) -> list[dict]:
    """The records of --data, a self-distillation jsonl (distill.selfdistill.read_records); ValueError
    naming --data when `path` does not exist, is not a file or holds no complete record."""
    from distill.selfdistill import RECORDS, read_records

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
    import runtime
    from distill.selfdistill import check_chat_template, check_records_file, generate_selfdistill, sharegpt_prompts
    from distill.train_medusa import check_cache_dir

    check_records_file(args.out)  # bad output paths fail before the model loads
    if args.hidden_cache:
        check_cache_dir(args.hidden_cache)
    eagle_cache, eagle = getattr(args, "eagle_cache", None), None  # `eagle data --cache`
    if eagle_cache:
        from distill.eagle_cache import check_eagle_cache_dir
        from distill.train_eagle import EagleTrainConfig

        eagle = EagleTrainConfig(aux_layers=args.aux_layers, heldout_every=args.heldout_every)  # checked here
        check_eagle_cache_dir(eagle_cache)
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


def cmd_train(args: argparse.Namespace) -> int:
    from accelerate import PartialState

    import runtime
    from distill.config_args import dataclass_from_args
    from distill.train_medusa import (
        MANIFEST,
        MedusaTrainConfig,
        cache_hidden_states,
        check_cache_dir,
        check_train_dir,
        train_medusa,
    )
    from runtime.outputs import created_output
    from specdec.drafters.medusa.heads import attach_medusa

    deadline = deadline_after(args.max_minutes)
    cfg = dataclass_from_args(MedusaTrainConfig, args)  # checked before any loading
    out = check_train_dir(args.out)  # so are the output directories and the data
    cache_dir = check_cache_dir(args.hidden_cache or out / "hidden_cache")
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
    import runtime
    from distill.train_medusa import data_vocab, head_accuracy, load_cached
    from specdec.drafters.medusa.heads import choose_tree
    from specdec.drafters.medusa.io import load_medusa, read_medusa_config, save_medusa
    from specdec.drafters.medusa.tree import expected_length

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
    import runtime
    from runtime.atomic import atomic_write_text
    from specdec.drafters.medusa.io import load_medusa
    from specdec.drafters.tree_cost import cost_report, describe, measure_trees
    from specdec.evaluation.prompts import encode, load_prompts

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
    from distill.selfdistill import generate_selfdistill, sharegpt_prompts

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


def register(subparsers) -> None:
    """Add `medusa data|train|tree` to the `specdec` CLI."""
    from distill.config_args import add_dataclass_args
    from distill.selfdistill import generate_selfdistill
    from distill.train_medusa import MedusaTrainConfig
    from specdec.drafters.medusa.heads import attach_medusa

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
    t.set_defaults(func=cmd_train)

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
