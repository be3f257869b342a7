"""Benchmark the Triton flash-attention kernels against PyTorch SDPA on a CUDA GPU (bf16).

Parts (choose with --parts):
  prefill  causal attention over T = 512 .. 8k new tokens, against SDPA's flash backend
           (torch.nn.attention.sdpa_kernel(SDPBackend.FLASH_ATTENTION)).
  verify   verification blocks of 1 .. 64 queries over caches of 1k .. 32k slots with a tree mask,
           against the runtime's SDPA backend given the same boolean mask; the kernel runs both
           with that mask (read tile by tile) and with the compact ancestor bitmask.
  decode   one query per row over a 32k cache: flash-decoding (split KV, automatic split count)
           against one program per (row, kv head) and SDPA.
  e2e      plain greedy decoding tokens/s of randomly initialised models with the real
           Qwen2.5-Coder 0.5B / 1.5B configs: specdec.generate with attention="triton" and "sdpa"
           against transformers generate() on the same weights.
  sweep    times each tile config of a small grid on the longest prefill, the largest verification
           block over the longest cache, and decoding (for re-tuning the config tables of
           runtime/kernels/flash_attention.py).

Prints one Markdown table per part; --json PATH also writes every row plus the GPU name,
versions and command line. Kernel timings are medians of triton.testing.do_bench.

    python benchmarks/bench_attention.py                      # prefill, verify, decode, e2e
    python benchmarks/bench_attention.py --parts e2e --json e2e.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

from runtime.progress import progress

HEAD_SHAPES = {"0.5b": (14, 2, 64), "1.5b": (12, 2, 128)}  # q heads, kv heads, head dim
QWEN_CONFIGS = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1),  # for --smoke
}
SWEEP_CONFIGS = [(64, 32, 4, 2), (64, 64, 4, 3), (128, 32, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3),
                 (128, 128, 8, 2), (16, 64, 4, 3), (16, 128, 4, 3), (32, 64, 4, 3)]


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="prefill,verify,decode,e2e",
                   help="comma-separated: prefill, verify, decode, e2e, sweep (default: %(default)s)")
    p.add_argument("--shape", choices=sorted(HEAD_SHAPES), default="1.5b",
                   help="attention head shape of Qwen2.5-Coder 0.5B (14 q / 2 kv heads, D=64) or 1.5B "
                        "(12 / 2, D=128) (default: %(default)s)")
    p.add_argument("--batch", type=int, default=1, help="rows per kernel call (default: %(default)s)")
    p.add_argument("--prefill-lens", type=ints, default=[512, 1024, 2048, 4096, 8192],
                   help="prefill lengths T (default: 512,1024,2048,4096,8192)")
    p.add_argument("--verify-queries", type=ints, default=[1, 4, 16, 64],
                   help="new tokens per verification block, <= 64 (default: 1,4,16,64)")
    p.add_argument("--cache-lens", type=ints, default=[1024, 4096, 16384, 32768],
                   help="cached slots before a verification block (default: 1024,4096,16384,32768)")
    p.add_argument("--decode-len", type=int, default=32768,
                   help="cache length of the decode part (default: %(default)s)")
    p.add_argument("--decode-batches", type=ints, default=[1, 4], help="rows in the decode part (default: 1,4)")
    p.add_argument("--models", default="0.5b,1.5b",
                   help="e2e model configs: 0.5b, 1.5b (real Qwen2.5-Coder shapes), tiny (default: %(default)s)")
    p.add_argument("--prompt-len", type=int, default=128, help="e2e prompt tokens (default: %(default)s)")
    p.add_argument("--new-tokens", type=int, default=256, help="e2e generated tokens (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="e2e timed runs, median reported (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs and weights (default: %(default)s)")
    p.add_argument("--json", dest="json_path", default=None, help="also write all rows to this JSON file")
    p.add_argument("--smoke", action="store_true",
                   help="check the script itself on the CPU under TRITON_INTERPRET=1 with tiny sizes you pass "
                        "(SDPA's math backend stands in for flash; timings mean nothing)")
    return p.parse_args(argv)


# ---- helpers ----------------------------------------------------------------------------

def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_ms(fn, device: torch.device) -> float:
    """Median milliseconds of fn() on the GPU (warm-up included); a 3-call median on a --smoke run."""
    if device.type != "cuda":
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return sorted(times)[1]
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def random_tree_bits(T: int, g: torch.Generator) -> torch.Tensor:
    """Ancestor-or-self bits (T,) of a random tree over T tokens, token 0 the root."""
    bits: list[int] = []
    for j in range(T):
        parent = int(torch.randint(0, j, (1,), generator=g)) if j else -1
        bits.append((bits[parent] if parent >= 0 else 0) | (1 << j))
    return torch.tensor([b - (1 << 64) if b >> 63 else b for b in bits], dtype=torch.long)  # bit 63: int64's sign


def cache_views(B: int, Hkv: int, S: int, D: int, g: torch.Generator):
    """K/V views (B, Hkv, S, D) of a static cache with 256 spare slots, as the runtime passes them."""
    shape = (B, Hkv, S + 256, D)
    k = torch.randn(shape, generator=g, dtype=torch.bfloat16, device=g.device)
    v = torch.randn(shape, generator=g, dtype=torch.bfloat16, device=g.device)
    return k[:, :, :S], v[:, :, :S]


def markdown(rows: list[dict], columns: list[str]) -> str:
    def fmt(x):
        return f"{x:.3f}" if isinstance(x, float) else str(x)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r[c]) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def sdpa_flash_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """SDPA's flash backend, causal; GQA through enable_gqa, else K/V repeated beforehand."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = SDPBackend.FLASH_ATTENTION if q.is_cuda else SDPBackend.MATH  # MATH: --smoke on the CPU

    def gqa():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    try:
        gqa()
        return gqa, "enable_gqa"
    except RuntimeError:  # this PyTorch's flash backend takes no GQA: repeat K/V outside the timing
        G = q.shape[1] // k.shape[1]
        kr, vr = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)

        def repeated():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, kr, vr, is_causal=True)

        return repeated, "K/V repeated"


# ---- parts ------------------------------------------------------------------------------

def run_prefill(args, g) -> list[dict]:
    from runtime.kernels.flash_attention import flash_attention

    Hq, Hkv, D = HEAD_SHAPES[args.shape]
    B, rows = args.batch, []
    for T in progress(args.prefill_lens, desc="prefill"):
        q = torch.randn(B, Hq, T, D, generator=g, dtype=torch.bfloat16, device=g.device)
        k, v = cache_views(B, Hkv, T, D, g)
        prefix = torch.zeros(B, dtype=torch.long, device=g.device)
        ours = lambda: flash_attention(q, k, v, prefix_lens=prefix)  # noqa: E731
        sdpa, how = sdpa_flash_causal(q, k, v)
        err = (ours().float() - sdpa().float()).abs().max().item()
        t_ours, t_sdpa = bench_ms(ours, g.device), bench_ms(sdpa, g.device)
        flops = 4 * B * Hq * T * T * D / 2  # causal: half the score matrix
        rows.append(dict(T=T, triton_ms=t_ours, sdpa_flash_ms=t_sdpa, speedup=t_sdpa / t_ours,
                         triton_tflops=flops / t_ours / 1e9, sdpa_tflops=flops / t_sdpa / 1e9,
                         max_abs_diff=err, sdpa_gqa=how))
    return rows


def run_verify(args, g) -> list[dict]:
    from runtime.attention import attend
    from runtime.kernels.flash_attention import flash_attention, visible_mask

    Hq, Hkv, D = HEAD_SHAPES[args.shape]
    B, rows = args.batch, []
    g_tree = torch.Generator().manual_seed(args.seed)
    cases = [(L, T) for L in args.cache_lens for T in args.verify_queries]
    for L, T in progress(cases, desc="verify"):
        if T > 64:
            raise SystemExit(f"--verify-queries: tree blocks hold at most 64 tokens, got {T}")
        q = torch.randn(B, T, Hq, D, generator=g, dtype=torch.bfloat16, device=g.device).transpose(1, 2)
        k, v = cache_views(B, Hkv, L + T, D, g)
        prefix = torch.full((B,), L, dtype=torch.long, device=g.device)
        bits = torch.stack([random_tree_bits(T, g_tree) for _ in range(B)]).to(g.device)  # (B, T)
        mask = visible_mask(prefix, T, L + T, tree_bits=bits)  # (B, T, S)
        with_mask = lambda: attend(q, k, v, mask, prefix, backend="triton")  # noqa: E731
        with_bits = lambda: flash_attention(q, k, v, prefix_lens=prefix, tree_bits=bits)  # noqa: E731
        sdpa = lambda: attend(q, k, v, mask, prefix, backend="sdpa")  # noqa: E731
        err = (with_bits().float() - sdpa().float()).abs().max().item()
        t_mask, t_bits, t_sdpa = bench_ms(with_mask, g.device), bench_ms(with_bits, g.device), bench_ms(sdpa, g.device)
        rows.append(dict(cache=L, queries=T, triton_mask_ms=t_mask, triton_bits_ms=t_bits, sdpa_mask_ms=t_sdpa,
                         speedup_mask=t_sdpa / t_mask, speedup_bits=t_sdpa / t_bits, max_abs_diff=err))
    return rows


def run_decode(args, g) -> list[dict]:
    from runtime.attention import attend
    from runtime.kernels.flash_attention import flash_attention

    Hq, Hkv, D = HEAD_SHAPES[args.shape]
    L, rows = args.decode_len, []
    for B in progress(args.decode_batches, desc="decode"):
        q = torch.randn(B, Hq, 1, D, generator=g, dtype=torch.bfloat16, device=g.device)
        k, v = cache_views(B, Hkv, L + 1, D, g)
        prefix = torch.full((B,), L, dtype=torch.long, device=g.device)
        split = lambda: flash_attention(q, k, v, prefix_lens=prefix)  # noqa: E731
        per_head = lambda: flash_attention(q, k, v, prefix_lens=prefix, num_splits=1)  # noqa: E731
        sdpa = lambda: attend(q, k, v, None, prefix, backend="sdpa")  # noqa: E731
        err = (split().float() - per_head().float()).abs().max().item()
        t_split, t_head, t_sdpa = bench_ms(split, g.device), bench_ms(per_head, g.device), bench_ms(sdpa, g.device)
        kv_bytes = 2 * k.numel() * k.element_size()
        rows.append(dict(batch=B, cache=L, split_kv_ms=t_split, one_program_per_head_ms=t_head, sdpa_ms=t_sdpa,
                         split_speedup=t_head / t_split, split_gb_s=kv_bytes / t_split / 1e6,
                         max_abs_diff=err))
    return rows


def run_sweep(args, g) -> list[dict]:
    from triton.runtime.errors import OutOfResources

    from runtime.kernels.flash_attention import FlashConfig, flash_attention

    Hq, Hkv, D = HEAD_SHAPES[args.shape]
    shapes = [("prefill", max(args.prefill_lens), 0), ("verify", max(args.verify_queries), max(args.cache_lens)),
              ("decode", 1, args.decode_len)]
    rows = []
    for name, T, L in progress(shapes, desc="sweep"):
        q = torch.randn(args.batch, Hq, T, D, generator=g, dtype=torch.bfloat16, device=g.device)
        k, v = cache_views(args.batch, Hkv, L + T, D, g)
        prefix = torch.full((args.batch,), L, dtype=torch.long, device=g.device)
        for bm, bn, warps, stages in SWEEP_CONFIGS:
            cfg = FlashConfig(bm, bn, warps, stages)
            for splits in {"prefill": [1], "verify": [1, None], "decode": [1, 4, 16, 64, None]}[name]:
                try:
                    ms = bench_ms(lambda: flash_attention(q, k, v, prefix_lens=prefix, num_splits=splits,
                                                          config=cfg), g.device)
                except OutOfResources as e:  # the config needs more shared memory than the GPU has
                    ms, note = float("nan"), str(e).splitlines()[0][:60]
                else:
                    note = ""
                rows.append(dict(shape=name, T=T, cache=L, block_m=bm, block_n=bn, warps=warps, stages=stages,
                                 splits="auto" if splits is None else splits, ms=ms, note=note))
    return rows


def qwen_config(name: str):
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=151936, rope_theta=1e6, max_position_embeddings=32768, tie_word_embeddings=True,
                       rms_norm_eps=1e-6, **QWEN_CONFIGS[name])


def gpu_or_smoke(args: argparse.Namespace, script: str, cpu_alternative: str) -> torch.device:
    """The device of a GPU benchmark script: CUDA, or the CPU for a --smoke run (which also sets
    args.target and args.draft to the tiny config); without CUDA, SystemExit naming `cpu_alternative`."""
    if args.smoke:
        args.target = args.draft = "tiny"
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit(f"{script}: run it on a CUDA machine, or with --smoke to check the script on a CPU "
                         f"({cpu_alternative})")
    return torch.device("cuda")


def random_qwen(name: str, dtype: torch.dtype, device: torch.device, attention: str | None = None):
    """(transformers model, runtime Transformer on the same weights) of a randomly initialised
    Qwen2.5-Coder config (QWEN_CONFIGS), initialised on `device` (a 1.5B model's random init takes
    tens of seconds on a CPU). Seed the global generator first: transformers initialises from it."""
    from transformers import AutoModelForCausalLM

    from runtime.loading import from_hf_state

    with device:
        hf = AutoModelForCausalLM.from_config(qwen_config(name), dtype=dtype).eval()
    return hf, from_hf_state(hf.state_dict(), hf.config, dtype=dtype, device=device, attention=attention)


def run_e2e(args, g) -> list[dict]:
    import statistics

    from transformers import AutoModelForCausalLM

    import specdec
    from runtime.loading import from_hf_state

    rows = []
    for name in progress(args.models.split(","), desc="e2e"):
        cfg = qwen_config(name)
        torch.manual_seed(args.seed)  # transformers initialises weights from the global generator
        with g.device:  # initialised on the GPU: a 1.5B model's random init takes tens of seconds on the CPU
            hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
        ids = torch.randint(0, cfg.vocab_size, (1, args.prompt_len), generator=torch.Generator().manual_seed(args.seed))
        n = args.new_tokens
        results, outputs = {}, {}
        for backend in ("triton", "sdpa"):
            model = from_hf_state(hf.state_dict(), cfg, dtype=torch.bfloat16, device=g.device, attention=backend)
            specdec.generate(model, ids, max_new_tokens=8)  # warm-up: kernel compilation
            times = []
            for _ in range(args.repeats):
                sync(g.device)
                start = time.perf_counter()
                out = specdec.generate(model, ids, max_new_tokens=n)
                sync(g.device)
                times.append(time.perf_counter() - start)
            results[backend], outputs[backend] = n / statistics.median(times), out.sequences[0, -n:].cpu()
            del model
        ids_gpu = ids.to(g.device)
        kwargs = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        hf.generate(ids_gpu, **{**kwargs, "max_new_tokens": 8, "min_new_tokens": 8})
        times = []
        for _ in range(args.repeats):
            sync(g.device)
            start = time.perf_counter()
            hf.generate(ids_gpu, **kwargs)
            sync(g.device)
            times.append(time.perf_counter() - start)
        hf_tps = n / statistics.median(times)
        same = (outputs["triton"] == outputs["sdpa"]).float().mean().item()
        rows.append(dict(model=f"qwen2.5-coder-{name} (random)", new_tokens=n, triton_tok_s=results["triton"],
                         sdpa_tok_s=results["sdpa"], transformers_tok_s=hf_tps,
                         triton_vs_transformers=results["triton"] / hf_tps, same_tokens_triton_sdpa=same))
        del hf
        if g.device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


PARTS = {"prefill": run_prefill, "verify": run_verify, "decode": run_decode, "sweep": run_sweep, "e2e": run_e2e}


def write_json(path: str, payload: dict) -> None:
    """Atomic write: temp file in the same directory, then rename."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(payload, f, indent=2)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise SystemExit(f"unknown --parts {unknown}; choose from {sorted(PARTS)}")
    bad_models = [m for m in args.models.split(",") if m not in QWEN_CONFIGS]
    if bad_models:
        raise SystemExit(f"unknown --models {bad_models}; choose from {sorted(QWEN_CONFIGS)}")
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--smoke runs the kernels on the Triton interpreter: set TRITON_INTERPRET=1")
    elif not torch.cuda.is_available():
        raise SystemExit("bench_attention.py needs a CUDA GPU: the Triton kernels are compiled for the GPU and "
                         "compared with CUDA SDPA. On the CPU run the interpreter tests instead: "
                         "python -m pytest -q tests/runtime/kernels")
    g = torch.Generator(device="cpu" if args.smoke else "cuda").manual_seed(args.seed)
    gpu = "CPU (smoke run, Triton interpreter)" if args.smoke else torch.cuda.get_device_name()
    print(f"GPU: {gpu}; torch {torch.__version__}; bf16; shape {args.shape} {HEAD_SHAPES[args.shape]} "
          f"(q heads, kv heads, head dim); batch {args.batch}\n")
    results = {}
    for part in parts:
        rows = PARTS[part](args, g)
        results[part] = rows
        if rows:
            print(f"### {part}\n\n{markdown(rows, list(rows[0]))}\n", flush=True)
    if args.json_path:
        import triton

        write_json(args.json_path, dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__,
                                        python=platform.python_version(), command=" ".join(sys.argv),
                                        shape=args.shape, batch=args.batch, results=results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
