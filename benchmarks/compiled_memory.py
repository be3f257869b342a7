"""Compiled programs and resident memory: do all block and batch sizes share one copy of the weights?

A server compiles a decode step, verification blocks of 8 and 16 tokens, at every batch size up
to --max-batch; every program reads the model's own tensors. This compiles every (batch, tokens)
program of one model in a fresh process and reports the resident set against weights + KV cache,
then the step time of a 1-token and an 8-token forward at batch 1 (median ms):

    python benchmarks/compiled_memory.py --model qwen2.5-coder-1.5b-instruct --out runs/compiled_memory
    python benchmarks/compiled_memory.py --model qwen2.5-coder-1.5b-instruct --weights gguf \\
        --batches 1 --tokens 1,2,4,8 --out runs/compiled_memory_gguf

Write the CPU model and flags (`runtime.hardware`) next to the figures.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import psutil
import torch
from cpu_gqa_attention import median_ms

from runtime.atomic import atomic_write_text
from runtime.hardware import cpu_summary
from runtime.loading import load_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def rss_bytes() -> int:
    return psutil.Process().memory_info().rss


def tensor_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers (each storage once)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def run(args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    model = load_model(args.model, dtype=DTYPES[args.dtype], weights=args.weights)
    weights = tensor_bytes(model)
    model.compile_decode()
    B_max = max(args.batches)
    caches = {b: model.new_cache(b, args.max_len) for b in args.batches}
    kv = sum(c.k.untyped_storage().nbytes() + c.v.untyped_storage().nbytes() for c in caches.values())
    base = rss_bytes()
    programs = []
    with torch.inference_mode():
        for b, cache in caches.items():
            prompt = torch.randint(0, model.config.vocab_size, (b, args.prompt_tokens))
            model(prompt, torch.arange(args.prompt_tokens)[None].expand(b, -1), cache)  # eager prefill
            for t in args.tokens:
                toks = torch.randint(0, model.config.vocab_size, (b, t))
                start = time.perf_counter()
                model(toks, cache.lengths[:, None] + torch.arange(t)[None], cache)
                cache.rollback(cache.lengths - t)
                programs.append({"batch": b, "tokens": t, "compile_s": round(time.perf_counter() - start, 1),
                                 "rss_gb": round(rss_bytes() / 1e9, 3)})
                print(programs[-1], flush=True)
        cache = caches[min(args.batches)]
        steps = {}
        for t in (1, 8):
            toks = torch.randint(0, model.config.vocab_size, (cache.batch_size, t))

            def step(toks=toks, t=t) -> None:
                model(toks, cache.lengths[:, None] + torch.arange(t)[None], cache)
                cache.rollback(cache.lengths - t)
            steps[f"{t}_token_ms"] = round(median_ms(step, args.repeats), 1)
    rss = rss_bytes()
    return {"model": args.model, "dtype": args.dtype,
            "batches": args.batches, "tokens": args.tokens, "max_len": args.max_len, "max_batch": B_max,
            "weights_gb": round(weights / 1e9, 3), "kv_cache_gb": round(kv / 1e9, 3),
            "rss_before_compile_gb": round(base / 1e9, 3), "rss_gb": round(rss / 1e9, 3),
            "rss_over_weights_plus_kv": round(rss / (weights + kv), 3), "programs": programs,
            "step_batch1": steps, "cpu": cpu_summary()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    p.add_argument("--weights", default="dense", choices=["dense", "gguf"],
                   help="a GGUF model dequantized (dense) or kept in its 4-bit blocks (gguf)")
    p.add_argument("--batches", default="1,2,3,4", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--tokens", default="1,8,16", type=lambda s: [int(x) for x in s.split(",")],
                   help="forward sizes to compile (1 = decode step, 8 and 16 = verification blocks)")
    p.add_argument("--max-len", type=int, default=1024, help="KV cache positions per row")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", default="runs/compiled_memory")
    args = p.parse_args()
    result = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "compiled_memory.json", json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "programs"}, indent=2))


if __name__ == "__main__":
    main()
