"""Grouped-query attention on the CPU: PyTorch SDPA with `enable_gqa` against `runtime.attention.sdpa_gqa`.

    python benchmarks/cpu_gqa_attention.py --model qwen2.5-coder-1.5b-instruct --batches 1,32,64,128

Part 1 times one attention call per shape (the model's query / KV heads and head size, bf16, a
boolean mask as the runtime passes it): decoding rows (T = 1) and a 24-node Medusa tree block
(T = 24), over 300 cached slots. Part 2 times one eager decoding step of the real checkpoint
(random token ids, 300 cached slots) at each batch size, with the runtime's attention as it is
(`sdpa_gqa`) and with `enable_gqa` patched in, alternating: the rate at which batched generation
(self-distillation data, the recipes' tau runs) makes tokens with each path.
Medians of `--repeats`; prints Markdown tables and writes `--json`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

import runtime
import runtime.attention
from runtime.atomic import atomic_write_text
from runtime.attention import sdpa_gqa


def median_ms(fn, repeats: int) -> float:
    """Median wall time of fn() in ms over `repeats` calls after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def enable_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The alternative to `sdpa_gqa`: PyTorch SDPA with `enable_gqa=True` (same arguments)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask[:, None],
                                          enable_gqa=q.shape[1] != k.shape[1])


def attention_rows(cfg, batches: list[int], slots: int, repeats: int) -> list[dict]:
    """One call of each attention path per (rows, queries) shape."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for B, T in [(b, 1) for b in batches] + [(1, 24)]:
        q = torch.randn(B, cfg.num_heads, T, cfg.head_dim, generator=g).bfloat16()  # (B, Hq, T, D)
        k = torch.randn(B, cfg.num_kv_heads, slots, cfg.head_dim, generator=g).bfloat16()  # (B, Hkv, S, D)
        v = torch.randn(B, cfg.num_kv_heads, slots, cfg.head_dim, generator=g).bfloat16()
        mask = torch.ones(B, T, slots, dtype=torch.bool)  # (B, T, S)
        gqa = median_ms(lambda: enable_gqa(q, k, v, mask), repeats)
        fold = median_ms(lambda: sdpa_gqa(q, k, v, mask), repeats)
        rows.append({"rows": B, "queries": T, "slots": slots, "enable_gqa_ms": gqa, "sdpa_gqa_ms": fold,
                     "speedup": gqa / fold})
    return rows


@torch.inference_mode()
def step_rows(model, batches: list[int], slots: int, repeats: int) -> list[dict]:
    """One eager decoding step of the whole model per batch size and attention path, `slots`
    tokens already cached; the two paths alternate step by step."""
    out = []
    for B in batches:
        cache = model.new_cache(B, slots + 2 * repeats + 4)
        cache.lengths[:] = slots
        tokens = torch.randint(100, 30000, (B, 1))
        times = {"enable_gqa": [], "sdpa_gqa": []}
        for i in range(2 * repeats + 2):
            path = "enable_gqa" if i % 2 else "sdpa_gqa"
            runtime.attention.sdpa_gqa = enable_gqa if path == "enable_gqa" else sdpa_gqa
            try:
                t = time.perf_counter()
                model(tokens, cache.lengths[:, None].clone(), cache)
                if i >= 2:  # the first step of each path is a warm-up
                    times[path].append(time.perf_counter() - t)
            finally:
                runtime.attention.sdpa_gqa = sdpa_gqa
        ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        out.append({"rows": B, "enable_gqa_step_ms": ms["enable_gqa"], "sdpa_gqa_step_ms": ms["sdpa_gqa"],
                    "tokens_per_second": {k: B / v * 1e3 for k, v in ms.items()},
                    "speedup": ms["enable_gqa"] / ms["sdpa_gqa"]})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--batches", default="1,32,64,128", help="comma-separated row counts")
    p.add_argument("--slots", type=int, default=300, help="tokens already in the KV cache")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    model = runtime.load_model(args.model, dtype=torch.bfloat16, weights="dense")
    att = attention_rows(model.config, batches, args.slots, args.repeats * 4)
    print("| rows x queries | SDPA enable_gqa (ms) | sdpa_gqa (ms) | speedup |\n|---|---:|---:|---:|")
    for r in att:
        print(f"| {r['rows']} x {r['queries']} | {r['enable_gqa_ms']:.2f} | {r['sdpa_gqa_ms']:.2f} "
              f"| {r['speedup']:.1f}x |")
    steps = step_rows(model, batches, args.slots, args.repeats)
    print("\n| rows | step, enable_gqa (ms) | step, sdpa_gqa (ms) | tokens/s enable_gqa -> sdpa_gqa | speedup |\n"
          "|---|---:|---:|---:|---:|")
    for r in steps:
        tps = r["tokens_per_second"]
        print(f"| {r['rows']} | {r['enable_gqa_step_ms']:.0f} | {r['sdpa_gqa_step_ms']:.0f} | "
              f"{tps['enable_gqa']:.1f} -> {tps['sdpa_gqa']:.1f} | {r['speedup']:.2f}x |")
    if args.json:
        atomic_write_text(args.json, json.dumps({"model": args.model, "torch": torch.__version__,
                                                 "threads": torch.get_num_threads(), "attention": att,
                                                 "decode_step": steps}, indent=1))


if __name__ == "__main__":
    main()
