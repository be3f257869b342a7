"""`specdec serve`: load a target and its drafter, then serve them over OpenAI-compatible HTTP.

    specdec serve --model qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct \\
        --max-batch 4 --port 8000

Drafters: `--draft NAME_OR_PATH` (a draft model), `--draft ngram` (prompt lookup), several joined
by '+' tried in order (`--draft ngram+NAME`), `--eagle PATH` (EAGLE-3 head; `--eagle-tree N` keeps
N tree nodes, `auto` times tree sizes on this machine at start-up) or `--medusa PATH` (Medusa
heads); none = plain decoding. Loading a drafter reports on stderr (`specdec generate` shares it).
Requests join the running batch between steps (`specdec.engine.Engine`, at most --max-batch rows).
The address is checked and the models loaded before the server starts, so a taken port or a bad
model path fails at once with one line.
"""

from __future__ import annotations

import argparse
import errno
import socket
import sys

from runtime.hardware import DTYPES
from runtime.loading import WEIGHTS
from specdec.options import WEIGHTS_HELP


def check_address(host: str, port: int) -> None:
    """Fail fast (before any model loads) when host:port cannot be bound."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as err:
            hint = "another process listens there: pick another --port" if err.errno == errno.EADDRINUSE \
                else "check --host and --port"
            raise ValueError(f"cannot listen on {host}:{port} ({err.strerror}); {hint}") from err


def load_drafter(args: argparse.Namespace, target):
    """The `draft` argument of the Engine (and of generate()) for --draft / --eagle / --medusa (None =
    plain decoding)."""
    import runtime

    dtype = DTYPES[args.dtype]
    if args.eagle:
        return _eagle_drafter(args, target)
    if args.medusa:
        from specdec.medusa_io import load_medusa

        print(f"loading Medusa heads {args.medusa}", file=sys.stderr, flush=True)
        return load_medusa(args.medusa, target)
    if not args.draft:
        return None
    drafts = []
    for part in args.draft.split("+"):
        if part == "ngram":
            drafts.append("ngram")
            continue
        compile_ = getattr(args, "compile", False)
        print(f"loading draft model {part} ({args.dtype}, {args.device}{', compiled' if compile_ else ''})",
              file=sys.stderr, flush=True)
        drafts.append(runtime.load_model(part, dtype=dtype, device=args.device, compile=compile_,
                                         weights=args.weights))
    return drafts if len(drafts) > 1 else drafts[0]


# the prompt `--eagle-tree auto` times tree sizes on (a server has no prompt set of its own)
CALIBRATION_PROMPT = ("Write a Python function that returns the longest palindromic substring of a string, "
                      "with a docstring and a few doctests.")


def _eagle_drafter(args: argparse.Namespace, target):
    """The EAGLE-3 drafter of --eagle with --eagle-tree / --eagle-depth / --eagle-top-k."""
    import torch

    import runtime
    from specdec.drafters.eagle import EagleDrafter, EagleTreeConfig
    from specdec.eagle_io import load_eagle
    from specdec.prompts import encode

    print(f"loading EAGLE-3 head {args.eagle}", file=sys.stderr, flush=True)
    head = load_eagle(args.eagle, target)
    if args.eagle_tree != "auto":
        return EagleDrafter(head, target, EagleTreeConfig(args.eagle_depth, args.eagle_top_k, args.eagle_tree))
    from specdec.eagle_auto import auto_tree, describe

    tok = runtime.load_tokenizer(args.model)
    ids = encode(tok, [CALIBRATION_PROMPT], [], raw=not getattr(tok, "chat_template", None))
    print("timing EAGLE-3 tree sizes on this machine (--eagle-tree auto)", file=sys.stderr, flush=True)
    tree, record = auto_tree(target, head, [torch.tensor(ids)], depth=args.eagle_depth, top_k=args.eagle_top_k)
    print(describe(record), file=sys.stderr, flush=True)
    return EagleDrafter(head, target, tree)


def main(args: argparse.Namespace) -> int:
    """Entry point of `specdec serve`: check the address, load, then serve until interrupted."""
    import runtime
    from specdec.engine import Engine
    from specdec.evaluate import eos_ids
    from specdec.server import create_app, serve

    if args.max_batch < 1:
        raise ValueError(f"--max-batch must be >= 1, got {args.max_batch}")
    check_address(args.host, args.port)
    print(f"loading target {args.model} ({args.dtype}, {args.device}{', compiled' if args.compile else ''})",
          flush=True)
    target = runtime.load_model(args.model, dtype=DTYPES[args.dtype], device=args.device, compile=args.compile,
                                weights=args.weights, row_invariant=not args.no_row_invariant)
    tokenizer = runtime.load_tokenizer(args.model)
    draft = load_drafter(args, target)
    eos = eos_ids(args.model, tokenizer)
    engine = Engine(target, draft, max_batch=args.max_batch, max_len=args.max_len,
                    num_draft_tokens=args.num_draft_tokens, eos_token_id=eos or None)
    name = args.served_model_name or args.model
    drafter = args.draft or (f"eagle:{args.eagle}" if args.eagle else f"medusa:{args.medusa}" if args.medusa
                             else "none (plain decoding)")
    print(f"serving {name!r} on http://{args.host}:{args.port}/v1 (drafter {drafter}, max batch {args.max_batch}, "
          f"eos ids {eos})", flush=True)
    print(batch_mode(target), flush=True)
    serve(create_app(engine, tokenizer, name, max_model_len=args.max_len), host=args.host, port=args.port,
          log_level=args.log_level)
    return 0


def batch_mode(target) -> str:
    """One line saying whether a greedy answer depends on the batch it is decoded in."""
    if getattr(target, "row_invariant", False):
        return ("row-invariant kernels: a greedy answer is the same whatever requests share its batch, and "
                "equals plain decoding")
    return ("batch-dependent kernels (--no-row-invariant, float32, or a device without the row-invariant "
            "kernels): in bf16 a greedy answer may differ at near-tied tokens with the requests sharing its batch")


def add_drafter_args(p: argparse.ArgumentParser) -> None:
    """--draft / --eagle / --medusa and the EAGLE-3 tree's options (`load_drafter` reads them;
    `specdec generate` shares them)."""
    from specdec.cli import tree_nodes_arg

    drafter = p.add_mutually_exclusive_group()
    drafter.add_argument("--draft", default=None, help="a draft model (name or dir), 'ngram', or several joined "
                         "by '+' tried in order (e.g. 'ngram+qwen2.5-coder-0.5b-instruct'); omit for plain decoding")
    drafter.add_argument("--eagle", default=None, metavar="PATH", help="an EAGLE-3 head directory")
    drafter.add_argument("--medusa", default=None, metavar="PATH", help="a Medusa heads directory")
    p.add_argument("--eagle-tree", type=tree_nodes_arg, default=48, metavar="N|auto",
                   help="--eagle: nodes the dynamic tree keeps (at most top_k + (depth - 1) * top_k^2), or auto to "
                        "time sizes up to 64 on this machine first (small trees win on a CPU; default: %(default)s)")
    p.add_argument("--eagle-depth", type=int, default=5, help="--eagle: levels of the tree (default: %(default)s)")
    p.add_argument("--eagle-top-k", type=int, default=8, help="--eagle: children per expanded node and nodes "
                   "expanded per level (default: %(default)s)")


def register(subparsers) -> argparse.ArgumentParser:
    """Add the `serve` subcommand to an argparse subparsers object."""
    from specdec.cli import DEFAULT_MODEL, draft_length_arg

    p = subparsers.add_parser("serve", help="serve a model over OpenAI-compatible HTTP with continuous batching",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="target: catalogue name, checkpoint dir, .gguf or hub id "
                   "(default: %(default)s)")
    add_drafter_args(p)
    p.add_argument("--max-batch", type=int, default=4, help="rows decoded together (default: %(default)s)")
    p.add_argument("--max-len", type=int, default=None, help="prompt + generated tokens per request (default: the "
                   "model's context)")
    p.add_argument("--num-draft-tokens", type=draft_length_arg, default=5, help="drafts per step (default: "
                   "%(default)s)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s, loopback "
                   "only; 0.0.0.0 exposes the server to the network)")
    p.add_argument("--port", type=int, default=8000, help="(default: %(default)s)")
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES), help="(default: %(default)s)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: %(default)s)")
    p.add_argument("--weights", default="auto", choices=list(WEIGHTS), help=WEIGHTS_HELP)
    p.add_argument("--compile", action="store_true", help="torch.compile the decode steps of the target and "
                   "draft models (the first request of each shape compiles)")
    p.add_argument("--no-row-invariant", action="store_true",
                   help="the batch-dependent kernels instead of the row-invariant ones (bf16 on the CPU): a "
                        "greedy answer may then differ with the requests it shares a batch with")
    p.add_argument("--served-model-name", default=None, help="the model name requests must use (default: --model)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default: %(default)s)")
    p.set_defaults(func=main)
    return p
