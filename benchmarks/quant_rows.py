"""Quantized models on many rows: kernel crossover, long forwards, verification blocks, memory.

Every call of a quantized linear picks its kernel by row count and dtype (`runtime.qlinear`):
the packed weight-only kernels for few rows, dequantize-a-tile + dense GEMM (`_tiled`) for many.
This measures what that choice rests on and what it gives, each part alternating the variants
it compares within one run:

    python benchmarks/quant_rows.py --part crossover --model qwen2.5-coder-0.5b-instruct
    python benchmarks/quant_rows.py --part forward --models smollm2-135m-instruct,qwen2.5-coder-0.5b-instruct
    python benchmarks/quant_rows.py --part verify --model qwen2.5-coder-1.5b-instruct
    python benchmarks/quant_rows.py --part memory --model qwen2.5-coder-0.5b-instruct

- crossover: one MLP weight of the model per format (INT8, INT4 g64), per dtype and row count:
  the packed kernel against `_tiled` (ms); prints the first row count where `_tiled` wins.
- forward: a T-token forward (no cache) of the dense model and of its INT8 and INT4 g64 (RTN)
  copies (minmax grid), float32 and bf16: median seconds and the ratio to dense.
- verify: the INT4 g128 (RTN, minmax grid, LM head too) copy of the model, compiled, in --dtypes:
  one decode step against one 8-token verification block on a cache of the prompt (ms, median).
- memory: resident memory an INT4 g64 copy adds to a fresh process (after a 1-token and after a
  T-token forward) against the bytes of its tensors.
Random activations and RTN weights: no calibration data needed. The CPU's flags decide which
dtype is fast (`runtime.hardware`); write them next to the figures.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch
from cpu_gqa_attention import median_ms

from runtime.atomic import atomic_write_text
from runtime.loading import load_model, read_hf_config, resolve
from runtime.qlinear import Int4Linear, Int8Linear, pack_int4, packed_max_rows

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _modules(out_f: int, in_f: int, g: torch.Generator) -> dict[str, torch.nn.Module]:
    codes = torch.randint(0, 16, (out_f, in_f), generator=g)
    scales = torch.rand(out_f, in_f // 64, generator=g) * 0.01
    zeros = torch.randn(out_f, in_f // 64, generator=g) * 0.01
    q8 = torch.randint(-127, 128, (out_f, in_f), generator=g).to(torch.int8)
    return {"int8": Int8Linear(q8, torch.rand(out_f, generator=g) * 0.01),
            "int4": Int4Linear(pack_int4(codes), scales.to(torch.bfloat16), zeros.to(torch.bfloat16), 64)}


def crossover(model: str, rows: list[int], repeats: int) -> list[dict]:
    cfg = read_hf_config(resolve(model))
    g = torch.Generator().manual_seed(0)
    out = []
    for shape in ((cfg.intermediate_size, cfg.hidden_size), (cfg.hidden_size, cfg.intermediate_size)):
        for fmt, mod in _modules(*shape, g).items():
            for dname, dtype in DTYPES.items():
                won = None
                for r in rows:
                    x = torch.randn(r, shape[1], generator=g).to(dtype)
                    packed = median_ms(lambda: mod.packed_kernel(x), repeats)
                    tiled = median_ms(lambda: mod._tiled(x), repeats)
                    if won is None and tiled < packed:
                        won = r
                    out.append({"format": fmt, "dtype": dname, "shape": list(shape), "rows": r,
                                "packed_ms": packed, "tiled_ms": tiled})
                    print(f"{fmt} {dname:8s} {shape} rows {r:4d}: packed {packed:8.2f} ms  tiled {tiled:8.2f} ms",
                          flush=True)
                print(f"  -> tiled first wins at {won} rows (current limit: {packed_max_rows(fmt, dtype)})", flush=True)
    return out


def _quantized(name: str, dtype: torch.dtype, variant: str, include_lm_head: bool = False) -> torch.nn.Module:
    import quant

    model = load_model(name, dtype=dtype, weights="dense")
    if variant == "int8":
        quant.quantize_(model, quant.Int8WeightOnly(include_lm_head=include_lm_head), progress=False)
    elif variant.startswith("int4"):
        group = int(variant.split("-g")[1]) if "-g" in variant else 64
        # the minmax grid: RTN with the default mse grid search takes minutes on a 2-core CPU
        quant.quantize_(model, quant.Int4WeightOnly(group_size=group, include_lm_head=include_lm_head,
                                                    grid="minmax"), progress=False)
    return model


@torch.no_grad()
def forward(models: list[str], tokens: int, rounds: int) -> list[dict]:
    out = []
    for name in models:
        for dname, dtype in DTYPES.items():
            variants = {v: _quantized(name, dtype, v) for v in ("dense", "int8", "int4")}
            vocab = variants["dense"].config.vocab_size
            ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(0))
            pos = torch.arange(tokens)[None]
            times = {v: [] for v in variants}
            for v, m in variants.items():  # warm-up
                m(ids, pos, None)
            for _ in range(rounds):
                for v, m in variants.items():
                    t = time.perf_counter()
                    m(ids, pos, None)
                    times[v].append(time.perf_counter() - t)
            dense = statistics.median(times["dense"])
            for v, ts in times.items():
                s = statistics.median(ts)
                out.append({"model": name, "dtype": dname, "variant": v, "seconds": s, "vs_dense": s / dense})
                print(f"{name} {dname:8s} {v:5s}: {s:7.3f} s  {s / dense:5.2f}x dense", flush=True)
            del variants
            gc.collect()
    return out


@torch.no_grad()
def verify(model: str, block: int, rounds: int, prompt_tokens: int = 64, dtypes: tuple[str, ...] = ("bfloat16",),
           max_autotune: bool = False) -> list[dict]:
    out = []
    for dname in dtypes:
        dtype = DTYPES[dname]
        m = _quantized(model, dtype, "int4-g128", include_lm_head=True)
        m.compile_decode(max_autotune=max_autotune or None)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, m.config.vocab_size, (1, prompt_tokens + block), generator=g)
        cache = m.new_cache(1, prompt_tokens + block + 8)
        m(ids[:, :prompt_tokens], torch.arange(prompt_tokens)[None], cache)

        def step(t: int, m=m, cache=cache, ids=ids) -> None:
            n = int(cache.lengths[0])
            m(ids[:, prompt_tokens:prompt_tokens + t], torch.arange(n, n + t)[None], cache)
            cache.lengths[:] = n  # roll back: every call scores the same positions

        for t in (1, block):
            step(t)  # compile
        times = {1: [], block: []}
        for _ in range(rounds):
            for t in times:
                a = time.perf_counter()
                step(t)
                times[t].append(time.perf_counter() - a)
        one, blk = statistics.median(times[1]) * 1e3, statistics.median(times[block]) * 1e3
        out.append({"model": model, "dtype": dname, "max_autotune": max_autotune,
                    "decode_ms": one, "block": block, "block_ms": blk, "ratio": blk / one})
        how = "compiled" + " max-autotune" * max_autotune
        print(f"{model} INT4 g128 {how} {dname}: decode step {one:.1f} ms, {block}-token block {blk:.1f} ms "
              f"({blk / one:.2f}x)", flush=True)
        del m
        gc.collect()
    return out


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@torch.no_grad()
def memory(model: str, tokens: int) -> list[dict]:
    """Quantize `model` to INT4 g64, save it compressed, then load it in a fresh process and measure
    what it adds there (this process's RSS still holds the dense copy it quantized)."""
    import subprocess
    import sys
    import tempfile

    import quant

    with tempfile.TemporaryDirectory() as tmp:
        quant.save_compressed(_quantized(model, torch.bfloat16, "int4"), tmp)
        gc.collect()
        out = subprocess.run([sys.executable, __file__, "--part", "memory-load", "--model", tmp,
                              "--tokens", str(tokens)], check=True, capture_output=True, text=True).stdout
    row = {"model": model, **json.loads(out.strip().splitlines()[-1])}
    print(f"{model} INT4 g64 bf16: tensors {row['tensor_bytes'] / 2**20:.1f} MiB; resident +"
          f"{row['rss_added_bytes_1'] / 2**20:.1f} MiB ({row['ratio_1']:.2f}x) after a 1-token forward, +"
          f"{row[f'rss_added_bytes_{tokens}'] / 2**20:.1f} MiB ({row[f'ratio_{tokens}']:.2f}x) after a "
          f"{tokens}-token forward", flush=True)
    return [row]


@torch.no_grad()
def memory_load(path: str, tokens: int) -> None:
    """(--part memory-load, run by `memory`) RSS added by loading compressed checkpoint `path` and
    running a 1-token then a `tokens`-token forward, against the bytes of its tensors; prints one
    JSON line. A tiny INT4 model runs the same forwards first, so the pages of PyTorch's own code
    that the first calls bring in are not counted as the model's."""
    import quant
    from runtime.tiny import tiny_model

    warm = tiny_model(dtype=torch.bfloat16, hidden_size=128, intermediate_size=256)
    quant.quantize_(warm, quant.Int4WeightOnly(group_size=64, grid="minmax"), progress=False)
    for t in (1, tokens):
        warm(torch.zeros(1, t, dtype=torch.long), torch.arange(t)[None], None)
    del warm
    gc.collect()
    before = _rss()
    m = load_model(path, dtype=torch.bfloat16, weights="dense")
    size = sum({t.data_ptr(): t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()]}.values())
    row: dict = {"tensor_bytes": size}
    for t in (1, tokens):
        m(torch.zeros(1, t, dtype=torch.long), torch.arange(t)[None], None)
        gc.collect()
        row[f"rss_added_bytes_{t}"] = _rss() - before
        row[f"ratio_{t}"] = row[f"rss_added_bytes_{t}"] / size
    print(json.dumps(row))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", required=True, choices=["crossover", "forward", "verify", "memory", "memory-load"])
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", help="catalogue name or checkpoint")
    p.add_argument("--models", default="smollm2-135m-instruct,qwen2.5-coder-0.5b-instruct",
                   help="comma-separated models (--part forward)")
    p.add_argument("--rows", default="1,2,4,8,16,24,32,48,64,128,256", help="row counts (--part crossover)")
    p.add_argument("--tokens", type=int, default=256, help="tokens of the forward (--part forward, memory)")
    p.add_argument("--block", type=int, default=8, help="verification block size (--part verify)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (medians)")
    p.add_argument("--dtypes", default="bfloat16", help="comma-separated (--part verify)")
    p.add_argument("--max-autotune", action="store_true",
                   help="--part verify: compile with Inductor's GEMM templates too (compile_decode(max_autotune=True))")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None, help="also write the figures to this file")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.part == "crossover":
        res = crossover(args.model, [int(r) for r in args.rows.split(",")], args.rounds)
    elif args.part == "forward":
        res = forward(args.models.split(","), args.tokens, args.rounds)
    elif args.part == "verify":
        res = verify(args.model, args.block, args.rounds, dtypes=tuple(args.dtypes.split(",")),
                     max_autotune=args.max_autotune)
    elif args.part == "memory":
        res = memory(args.model, args.tokens)
    else:
        memory_load(args.model, args.tokens)
        return
    if args.json:
        atomic_write_text(args.json, json.dumps({"part": args.part, "threads": args.threads, "results": res}, indent=1))


if __name__ == "__main__":
    main()
