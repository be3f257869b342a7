"""Decode speed of a model in bf16 vs its INT8 / INT4 copies (plain greedy decoding, static cache).

    python recipes/quant_decode_speed.py --model qwen2.5-coder-0.5b-instruct --variants bf16,int8,int4 --rounds 3

Quantized copies are made in memory with round-to-nearest (decode speed depends on the format,
not on how the codes were chosen: GPTQ checkpoints run the same kernels), or loaded from
`--int4-dir` / `--int8-dir` (the `int4` / `int8` variants), or named by a checkpoint directory
as a variant of its own (`runs/qwen05-int4-head`). A variant may carry its own thread count
(`int4+head@1`; default `--threads`): it is set before the variant compiles (Inductor's kernels
keep the count they were compiled with) and before each of its timed runs. Variants run
alternately, `--rounds` times each, after a warm-up; per variant the median tokens/s (new tokens
over the whole call, prefill included) and decode tokens/s (1 / time per output token after the
first), each with its ratio to the first variant, are printed. `--compile` runs
every variant through `runtime.compile_decode` (the compiling happens in the untimed warm-up).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import quant
import runtime
import specdec

PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring and tests."


def build(model_name: str, variant: str, dirs: dict[str, str | None]):
    path = dirs.get(variant) or (variant if Path(variant).is_dir() else None)
    if path:  # a compressed checkpoint (quant.save_compressed)
        return runtime.load_model(path, dtype=torch.bfloat16, weights="dense")
    model = runtime.load_model(model_name, dtype=torch.bfloat16, weights="dense")
    if variant == "int8":
        quant.quantize_(model, quant.Int8WeightOnly(), progress=False)
    elif variant == "int4":
        quant.quantize_(model, quant.Int4WeightOnly(group_size=128), progress=False)
    elif variant == "int8+head":
        quant.quantize_(model, quant.Int8WeightOnly(include_lm_head=True), progress=False)
    elif variant == "int4+head":
        quant.quantize_(model, quant.Int4WeightOnly(group_size=128, include_lm_head=True), progress=False)
    elif variant != "bf16":
        raise SystemExit(f"unknown variant {variant!r}")
    return model


def variant_threads(variant: str, default: int) -> int:
    """The thread count of a variant spec: `int4+head@1` -> 1, `bf16` -> default."""
    _, at, count = variant.rpartition("@")
    if not at:
        return default
    if not count.isdigit() or int(count) < 1:
        raise SystemExit(f"variant {variant!r}: the part after '@' is a thread count >= 1")
    return int(count)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--variants", default="bf16,int8,int4")
    ap.add_argument("--int8-dir", default=None)
    ap.add_argument("--int4-dir", default=None)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="runtime.compile_decode every variant (bf16 included)")
    ap.add_argument("--max-autotune", action="store_true",
                    help="with --compile: let Inductor autotune its own GEMM kernels (quantized matmuls too)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads of variants without an @THREADS suffix (1: with other jobs on the CPU, "
                         "more threads spin and run slower)")
    args = ap.parse_args()
    if args.max_autotune and not args.compile:
        ap.error("--max-autotune tunes the compiled programs: add --compile")
    tok = runtime.load_tokenizer(args.model)
    text = tok.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    variants = args.variants.split(",")
    threads = {v: variant_threads(v, args.threads) for v in variants}
    models = {v: build(args.model, v.rpartition("@")[0] or v, {"int8": args.int8_dir, "int4": args.int4_dir})
              for v in variants}
    outputs, speeds, decode = {}, {v: [] for v in variants}, {v: [] for v in variants}
    for v, m in models.items():  # warm-up (kernel packing, allocator, compiling)
        torch.set_num_threads(threads[v])
        if args.compile:
            runtime.compile_decode(m, max_autotune=args.max_autotune)
        specdec.generate(m, ids, max_new_tokens=8)
    for _ in range(args.rounds):
        for v, m in models.items():
            torch.set_num_threads(threads[v])
            t0 = time.perf_counter()
            out = specdec.generate(m, ids, max_new_tokens=args.max_new_tokens)
            wall = time.perf_counter() - t0
            new = out.sequences.shape[1] - ids.shape[1]
            speeds[v].append(new / wall)
            decode[v].append(1 / out.stats.tpot_s)
            outputs[v] = out.sequences[0, ids.shape[1]:]
            print(f"{v}: {new / wall:.2f} tokens/s with the prefill, {decode[v][-1]:.2f} decoding", flush=True)
    base, base_decode = statistics.median(speeds[variants[0]]), statistics.median(decode[variants[0]])
    for v in variants:
        med, med_decode = statistics.median(speeds[v]), statistics.median(decode[v])
        same = int((outputs[v] == outputs[variants[0]]).all()) if outputs[v].shape == outputs[variants[0]].shape else 0
        print(json.dumps({"variant": v, "tokens_per_s": round(med, 2), "runs": [round(s, 2) for s in speeds[v]],
                          f"speedup_vs_{variants[0]}": round(med / base, 3),
                          "decode_tokens_per_s": round(med_decode, 2),
                          f"decode_speedup_vs_{variants[0]}": round(med_decode / base_decode, 3),
                          "mib_in_memory": round(quant.model_nbytes(models[v]) / 2**20, 1),
                          f"same_tokens_as_{variants[0]}": bool(same)}), flush=True)

if __name__ == "__main__":
    main()
