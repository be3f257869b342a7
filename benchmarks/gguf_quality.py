"""Quality of a GGUF model run 4-bit (`weights="gguf"`) against its dequantized copy (`"dense"`).

    python benchmarks/gguf_quality.py --model qwen2.5-coder-1.5b-instruct --json runs/gguf_quality.json

Perplexity on held-out windows (`quant.eval_batches`: the held-out ShareGPT slice and Python
stdlib sources, `--windows` of `--seq-len` tokens each) of the same GGUF loaded both ways, in
`--dtype`. The weights are the same numbers (the block conversion is exact: tests); what differs
is the arithmetic: the block kernels round activations to int8 per 32 inputs (llama.cpp's), the
dense model multiplies bf16 (or float32) weights rounded from the same values. Prints both
perplexities and the relative difference, per source.
"""

from __future__ import annotations

import argparse
import json

import torch

import quant
import runtime
from runtime.hardware import DTYPES, cpu_summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--sources", default="sharegpt,stdlib")
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    tok = runtime.load_tokenizer(args.model)
    dtype = DTYPES[args.dtype]
    batches = {src: quant.eval_batches(tok, src, args.windows, args.seq_len) for src in args.sources.split(",")}
    result = {"model": args.model, "dtype": args.dtype, "windows": args.windows, "seq_len": args.seq_len,
              "cpu": cpu_summary(), "perplexity": {}}
    for weights in ("dense", "gguf"):
        model = runtime.load_model(args.model, dtype=dtype, weights=weights)
        with torch.inference_mode():
            for src, windows in batches.items():
                result["perplexity"].setdefault(src, {})[weights] = quant.perplexity(model, windows, progress=False)
        del model
    print(f"{args.model}, {args.dtype}, {args.windows} windows of {args.seq_len} tokens per source")
    print(f"{'source':<10} {'dense':>10} {'gguf 4-bit':>11} {'difference':>11}")
    for src, ppl in result["perplexity"].items():
        ppl["relative_difference"] = ppl["gguf"] / ppl["dense"] - 1
        print(f"{src:<10} {ppl['dense']:10.4f} {ppl['gguf']:11.4f} {ppl['relative_difference']:+11.2%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
