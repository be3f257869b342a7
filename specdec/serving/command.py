"""`specdec serve`: load a target and its drafter, then serve them over OpenAI-compatible HTTP.

    specdec serve --model qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct \\
        --max-batch 4 --port 8000

Drafters: `--draft SPEC` in the grammar of `specdec eval --methods` (specdec.methods):
`ngram[@K]`, `draft:NAME_OR_PATH[@K]` (a bare NAME_OR_PATH is a draft model too), chain drafters
joined by '+' tried in order (`ngram+NAME`), `medusa:DIR[@N]`, `eagle:DIR[@N[:DxK]]` or
`eagle:DIR@auto` (tree sizes timed on this machine at start-up); none = plain decoding. The
deprecated `--eagle PATH` (with `--eagle-tree`, `--eagle-depth`, `--eagle-top-k`) and `--medusa
PATH` still work: each stands for the spec `legacy_draft` writes, read by the same parser. Loading
a drafter reports on stderr (`specdec generate` shares it).
Requests join the running batch between steps (`specdec.serving.engine.Engine`, at most --max-batch rows).
The address is checked and the models loaded before the server starts, so a taken port or a bad
model path fails at once with one line.
"""

from __future__ import annotations

import argparse
import errno
import socket
import sys
import warnings

import torch

import runtime
from runtime.argtypes import int_at_least, port_number, positive_int
from runtime.hardware import DTYPES
from runtime.loading import WEIGHTS
from specdec.cli import DEFAULT_MODEL, draft_length_arg, tree_nodes_arg
from specdec.drafters.eagle.drafter import EagleTreeConfig
from specdec.evaluation.prompts import encode, eos_ids
from specdec.loader import DrafterLoader
from specdec.methods import DrafterSpec
from specdec.options import DEFAULT_NUM_DRAFT_TOKENS, WEIGHTS_HELP
from specdec.serving.engine import Engine
from specdec.tuning.eagle_tree import TreeTuner
from specdec.tuning.state import TuningState
from specdec.tuning.warmup import compile_block_steps


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


def check_names(args: argparse.Namespace) -> None:
    """Refuse an empty --host (the socket layer would bind every interface, not the loopback the
    default promises) and an empty --served-model-name (no request could name the model)."""
    if not args.host.strip():
        raise ValueError("--host is empty, which would listen on every interface; pass 127.0.0.1 (loopback "
                         "only, the default) or 0.0.0.0 to listen on all interfaces")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise ValueError("--served-model-name is empty, a name no request can send; pass a name or leave it out "
                         "(requests then name --model)")


EAGLE_TREE_FLAGS = (("eagle_tree", "--eagle-tree"), ("eagle_depth", "--eagle-depth"), ("eagle_top_k", "--eagle-top-k"))


def check_drafter_flags(args: argparse.Namespace) -> None:
    """ValueError for drafter options that would be quietly dropped: an empty --draft, --eagle or
    --medusa (which would mean plain decoding) and the EAGLE-3 tree options without --eagle
    (drafter_spec reads them only with --eagle; an eagle:DIR spec carries its tree in the spec)."""
    for flag, what in (("draft", "a drafter spec (e.g. ngram or draft:NAME_OR_PATH)"),
                       ("eagle", "an EAGLE-3 head directory"), ("medusa", "a Medusa heads directory")):
        value = getattr(args, flag)
        if value is not None and not value.strip():
            raise ValueError(f"--{flag} is empty; pass {what}, or omit --{flag} for plain decoding")
    given = [flag for name, flag in EAGLE_TREE_FLAGS if getattr(args, name) is not None]
    if given and not args.eagle:
        where = ("write the tree in the --draft spec instead (eagle:DIR@N:DEPTHxTOP_K)"
                 if args.draft and args.draft.strip().startswith("eagle:") else "add --eagle PATH (an EAGLE-3 head)")
        verb = "applies" if len(given) == 1 else "apply"
        raise ValueError(f"{', '.join(given)} only {verb} with --eagle; {where}, or drop {' and '.join(given)}")


def legacy_draft(args: argparse.Namespace) -> str | None:
    """The --draft spec the deprecated --eagle (with --eagle-tree / --eagle-depth / --eagle-top-k) or
    --medusa stand for; None when neither is given."""
    path = args.eagle or args.medusa
    if not path:
        return None
    path += "/" if "@" in path and not path.endswith("/") else ""  # an '@' in a directory's name stays in it
    if args.medusa:
        return f"medusa:{path}"
    depth, top_k, nodes = args.eagle_depth, args.eagle_top_k, args.eagle_tree
    shape = "" if depth is None and top_k is None else \
        f":{EagleTreeConfig.depth if depth is None else depth}x{EagleTreeConfig.top_k if top_k is None else top_k}"
    if nodes is None and shape:
        nodes = EagleTreeConfig.total_tokens
    return f"eagle:{path}" + ("" if nodes is None else f"@{nodes}{shape}")


def drafter_spec(args: argparse.Namespace) -> DrafterSpec | None:
    """The DrafterSpec of --draft (or of the deprecated --eagle / --medusa, `legacy_draft`, with a
    FutureWarning saying what to write instead); None = plain decoding. Options that would be
    dropped are refused first (check_drafter_flags)."""
    check_drafter_flags(args)
    legacy = legacy_draft(args)
    if legacy is not None:
        flag = "--eagle" if args.eagle else "--medusa"
        warnings.warn(f"{flag} is deprecated and will be removed: write --draft {legacy}", FutureWarning,
                      stacklevel=2)
        return DrafterSpec.parse(legacy)
    return DrafterSpec.parse(args.draft, bare="draft") if args.draft else None


def load_drafter(args: argparse.Namespace, target):
    """The `draft` argument of the Engine (and of generate()) for --draft / --eagle / --medusa (None =
    plain decoding): the spec's models and heads, loaded as --dtype / --device / --weights /
    --compile say, each load reported on stderr."""
    spec = drafter_spec(args)
    if spec is None:
        return None
    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    loader = DrafterLoader(log=log, state=TuningState(), tuner=TreeTuner(lambda: _calibration(args.model)),
                           dtype=DTYPES[args.dtype], device=args.device, compile=getattr(args, "compile", False),
                           weights=args.weights)
    return spec.load(target, loader)


# the prompt an `@auto` EAGLE-3 tree is timed on (a server has no prompt set of its own)
CALIBRATION_PROMPT = ("Write a Python function that returns the longest palindromic substring of a string, "
                      "with a docstring and a few doctests.")


def _calibration(model: str):
    """(label, ids) of CALIBRATION_PROMPT, tokenized when an @auto tree asks for it."""
    tok = runtime.load_tokenizer(model)
    yield "calibration", torch.tensor(encode(tok, [CALIBRATION_PROMPT], [], raw=not getattr(tok, "chat_template",
                                                                                           None)))


def main(args: argparse.Namespace) -> int:
    """Entry point of `specdec serve`: check the address, load, then serve until interrupted."""
    from specdec.serving.server import create_app, serve  # fastapi and uvicorn: only when serving, not at CLI start

    if args.max_batch < 1:
        raise ValueError(f"--max-batch must be >= 1, got {args.max_batch}")
    check_names(args)
    check_address(args.host, args.port)
    spec = drafter_spec(args)  # a bad --draft fails before any model loads
    print(f"loading target {args.model} ({args.dtype}, {args.device}{', compiled' if args.compile else ''})",
          flush=True)
    target = runtime.load_model(args.model, dtype=DTYPES[args.dtype], device=args.device, compile=args.compile,
                                weights=args.weights, row_invariant=not args.no_row_invariant)
    tokenizer = runtime.load_tokenizer(args.model)
    draft = load_drafter(args, target)
    eos = eos_ids(args.model, tokenizer)
    engine = Engine(target, draft, max_batch=args.max_batch, max_len=args.max_len,
                    num_draft_tokens=own_draft_length(spec, args.num_draft_tokens), eos_token_id=eos or None,
                    prefix_cache_tokens=args.prefix_cache_tokens, kv_cache_tokens=args.kv_cache_tokens)
    if args.compile and spec is not None and spec.varying_blocks:
        print(f"compiling every verification block of {spec} (its trees change size every step)", flush=True)
        compile_block_steps(target, args.max_batch, cache=engine.loop.cache)
    name = args.served_model_name or args.model
    drafter = str(spec) if spec is not None else "none (plain decoding)"
    print(f"serving {name!r} on http://{args.host}:{args.port}/v1 (drafter {drafter}, max batch {args.max_batch}, "
          f"eos ids {eos})", flush=True)
    print(batch_mode(target), flush=True)
    print(kv_cache_line(engine), flush=True)
    print(prefix_cache_line(engine), flush=True)
    if args.compile:
        print("--compile: the first request of each batch shape compiles its decode steps (a minute or more on a CPU); "
              "later ones run at speed", flush=True)
    serve(create_app(engine, tokenizer, name, max_model_len=args.max_len), host=args.host, port=args.port,
          log_level=args.log_level)
    return 0


def own_draft_length(spec: DrafterSpec | None, num_draft_tokens: int | str) -> int | str:
    """--num-draft-tokens, or the spec's own @K in its place."""
    own = spec.draft_length if spec is not None else None
    return num_draft_tokens if own is None else own


def batch_mode(target) -> str:
    """One line saying whether a greedy answer depends on the batch it is decoded in."""
    if getattr(target, "row_invariant", False):
        return ("row-invariant kernels: a greedy answer is the same whatever requests share its batch, and "
                "equals plain decoding")
    return ("batch-dependent kernels (--no-row-invariant, float32, or a device without the row-invariant "
            "kernels): in bf16 a greedy answer may differ at near-tied tokens with the requests sharing its batch")


def kv_cache_line(engine: Engine) -> str:
    """One line saying how the target's keys and values are held: per-row slots or a paged pool."""
    cache = engine.loop.cache
    if cache.block_table is None:
        return f"KV cache: {engine.max_batch} rows x {cache.max_seq_len} positions, each row its own"
    return (f"KV cache: paged, {cache.num_blocks * cache.block_size} positions in blocks of {cache.block_size} "
            f"shared by {engine.max_batch} rows; the latest request is preempted if it runs out")


def prefix_cache_line(engine: Engine) -> str:
    """One line saying how much of earlier prompts the engine keeps for later ones."""
    p = engine.prefixes
    if p is None:
        return "prefix cache off: every prompt is prefilled whole"
    return (f"prefix cache: {p.num_blocks * p.block} positions in blocks of {p.block}; a prompt that starts like an "
            "earlier prompt or conversation prefills only what it adds")


def add_drafter_args(p: argparse.ArgumentParser) -> None:
    """--draft / --eagle / --medusa and the EAGLE-3 tree's options (`load_drafter` reads them;
    `specdec generate` shares them)."""
    drafter = p.add_mutually_exclusive_group()
    drafter.add_argument("--draft", default=None, metavar="SPEC",
                         help="the drafter, as in specdec eval --methods: ngram[@K], suffix[@N] (suffix decoding, its "
                              "cache of earlier answers shared by every request), draft:NAME_OR_PATH[@K[:pP]] (or "
                              "just NAME_OR_PATH; :pP stops a draft below probability P), several chain drafters "
                              "joined by '+' tried in order (e.g. 'ngram+qwen2.5-coder-0.5b-instruct'), several "
                              "joined by '|' the best chosen per step (e.g. 'suffix|draft:NAME@auto'), "
                              "medusa:DIR[@N], eagle:DIR[@N[:DxK]] or eagle:DIR@auto; @K replaces "
                              "--num-draft-tokens; omit for plain decoding")
    drafter.add_argument("--eagle", default=None, metavar="PATH", help="deprecated: write --draft eagle:PATH@N:DxK "
                         "(this flag, with the three options below, stands for that spec)")
    drafter.add_argument("--medusa", default=None, metavar="PATH", help="deprecated: write --draft medusa:PATH")
    p.add_argument("--eagle-tree", type=tree_nodes_arg, default=None, metavar="N|auto",
                   help="deprecated, with --eagle (write eagle:PATH@N): nodes the dynamic tree keeps (at most "
                        "top_k + (depth - 1) * top_k^2), or auto to time sizes up to 64 on this machine first "
                        f"(default: {EagleTreeConfig.total_tokens})")
    p.add_argument("--eagle-depth", type=positive_int, default=None, help="deprecated, with --eagle (write "
                   f"eagle:PATH@N:DxK): levels of the tree (default: {EagleTreeConfig.depth})")
    p.add_argument("--eagle-top-k", type=positive_int, default=None, help="deprecated, with --eagle (write "
                   "eagle:PATH@N:DxK): children per expanded node and nodes expanded per level (default: "
                   f"{EagleTreeConfig.top_k})")


def register(subparsers) -> argparse.ArgumentParser:
    """Add the `serve` subcommand to an argparse subparsers object."""
    p = subparsers.add_parser("serve", help="serve a model over OpenAI-compatible HTTP with continuous batching",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="target: catalogue name, checkpoint dir, .gguf or hub id "
                   "(default: %(default)s)")
    add_drafter_args(p)
    p.add_argument("--max-batch", type=positive_int, default=4, help="rows decoded together (default: %(default)s)")
    p.add_argument("--max-len", type=positive_int, default=None, help="prompt + generated tokens per request "
                   "(default: the model's context)")
    p.add_argument("--prefix-cache-tokens", type=int_at_least(0), default=None, metavar="N",
                   help="positions of keys and values kept of earlier prompts and answers, so a request that "
                        "resends a conversation or shares a system prompt prefills only what it adds (default: "
                        "max batch x max len; 0: off)")
    p.add_argument("--kv-cache-tokens", type=int_at_least(0), default=None, metavar="N",
                   help="positions of the paged KV cache the rows share (blocks of 16, taken as a request grows "
                        "and given back when it ends; the prefix cache keeps its blocks there too), so short "
                        "requests can fill more rows (--max-batch) than N / max len; when it runs out, the latest "
                        "request is preempted and admitted again later (default: 2 x max batch x max len; 0: "
                        "per-row slots of max len positions, the prefix cache a pool of its own)")
    p.add_argument("--num-draft-tokens", type=draft_length_arg, default=DEFAULT_NUM_DRAFT_TOKENS,
                   help="drafts per step (default: %(default)s)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s, loopback "
                   "only; 0.0.0.0 exposes the server to the network)")
    p.add_argument("--port", type=port_number, default=8000, help="(default: %(default)s)")
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
