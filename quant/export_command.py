"""`specdec export gguf`: a checkpoint, compressed checkpoint or EAGLE-3 head as a GGUF llama.cpp runs.

    specdec export gguf out/qwen-1.5b-int4 --out qwen-1.5b-q4_1.gguf
    specdec export gguf out/eagle_smollm2 --target smollm2-135m-instruct --out eagle.gguf
"""

from __future__ import annotations

import argparse

from quant.gguf_export import DENSE_TYPES, export_gguf
from quant.gguf_tensors import REQUANT
from runtime.argtypes import path_arg

EPILOG = """\
INT4 in groups of 32, 64 or 128 (RTN or GPTQ) becomes Q4_1 and per-channel INT8 becomes Q8_0 with the
same codes (only the block scales round to float16); other formats (NF4, 2:4 + INT4, INT4 in groups
of 16) are re-quantized (--requant), and the summary prints every kind's measured error. Run the file:
  llama-server -m FILE.gguf            (a draft: -md DRAFT.gguf --spec-type draft-simple)
  llama-server -m TARGET.gguf -md EAGLE.gguf --spec-type draft-eagle3
llama.cpp's converter comes from the llama-cpp-python sdist (fetched once, 77 MB), see docs/exports.md."""


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `export` command with its `gguf` subcommand; handlers are set with set_defaults(func=...)."""
    p = subparsers.add_parser("export", help="write checkpoints and heads for other engines (llama.cpp: gguf)",
                              description="Write specdec checkpoints and heads in other engines' formats.")
    sub = p.add_subparsers(dest="format", metavar="FORMAT", required=True)
    g = sub.add_parser("gguf", help="a model, compressed checkpoint or EAGLE-3 head as a GGUF file for llama.cpp",
                       description=__doc__.splitlines()[0], epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    g.add_argument("source", help="catalogue name, checkpoint directory (dense or written by specdec compress), "
                                  "or EAGLE-3 head directory (specdec eagle train)")
    g.add_argument("--out", required=True, type=path_arg, help="the .gguf file to write (atomically)")
    g.add_argument("--target", default=None,
                   help="an EAGLE-3 head's target model (catalogue name, directory or .gguf): llama.cpp takes its "
                        "tokenizer and embedding from it")
    g.add_argument("--dense-type", default="bf16", choices=DENSE_TYPES,
                   help="type of the float tensors (embeddings, norms, a dense model's linears)")
    g.add_argument("--requant", default="auto", choices=REQUANT,
                   help="what a quantized linear without an exact GGUF type becomes: auto = Q4_1 for 4-bit "
                        "formats, Q8_0 for 8-bit, a float copy for 2:4 sparse")
    g.add_argument("--overwrite", action="store_true", help="replace OUT if it is a GGUF file")
    g.set_defaults(func=run_gguf)
    return p


def run_gguf(args: argparse.Namespace) -> int:
    result = export_gguf(args.source, args.out, target=args.target, dense_type=args.dense_type,
                         requant=args.requant, overwrite=args.overwrite)
    print(result.summary())
    return 0
