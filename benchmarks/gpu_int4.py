"""INT4 linears on a CUDA GPU at the real qwen2.5-coder-1.5b shapes: 1 and 16 rows against the
device's memory bandwidth (random weights: the real checkpoints cannot reach a lent GPU).

    python benchmarks/gpu_int4.py --json runs/gpu_int4.json
    python benchmarks/gpu_int4.py --smoke          # on the CPU: checks that every variant runs

Variants per shape: dense bf16 `F.linear`; `Int4Linear` on CUDA, which runs PyTorch's tinygemm
kernel `_weight_int4pack_mm` (groups of 32: larger groups need K divisible by 8 groups, which
8960 is not for 128); `BlockQuantLinear` (the GGUF Q4_K form), whose CUDA path dequantizes per call
(it has no CUDA kernel of its own: a floor, not a kernel). Bandwidth: a device-to-device
copy of 1 GiB (read + write bytes), best of 10. Each timed call reads another copy of the weight
(a pool larger than the GPU's L2 cache), CUDA events, median of the calls.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from runtime.blockq import BlockQuantLinear
from runtime.qlinear import Int4Linear, pack_int4

SHAPES = {"w13": (17920, 1536), "w2": (1536, 8960), "lm_head": (151936, 1536)}


def copy_bandwidth(device: torch.device, gib: float = 1.0, repeats: int = 10) -> float:
    src = torch.empty(int(gib * 2**30), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = 0.0
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        best = max(best, 2 * src.numel() / (start.elapsed_time(end) / 1e3))
    return best


def modules(kind: str, N: int, K: int, g: torch.Generator, device: torch.device) -> torch.nn.Module:
    if kind == "bf16":
        lin = torch.nn.Linear(K, N, bias=False, dtype=torch.bfloat16)
        lin.weight.data = torch.randn(N, K, generator=g).to(torch.bfloat16) * 0.02
        return lin.to(device)
    if kind.startswith("int4_g"):
        G = int(kind.removeprefix("int4_g"))
        codes = torch.randint(0, 16, (N, K), generator=g)
        s = (torch.rand(N, K // G, generator=g) * 1e-3).to(torch.bfloat16)
        z = (torch.randn(N, K // G, generator=g) * 1e-3).to(torch.bfloat16)
        return Int4Linear(pack_int4(codes), s, z, G).to(device)
    q = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
    sc = torch.randint(1, 64, (N, K // 32), generator=g).to(torch.int8)
    mc = torch.randint(0, 64, (N, K // 32), generator=g).to(torch.int8)
    return BlockQuantLinear.from_canonical(q, sc, mc, torch.rand(N, K // 256, generator=g) * 1e-3,
                                           torch.rand(N, K // 256, generator=g) * 1e-3, 4, 32, 256).to(device)


def weight_bytes(m: torch.nn.Module) -> int:
    if isinstance(m, torch.nn.Linear):
        return m.weight.numel() * m.weight.element_size()
    return m.nbytes()


def time_calls(pool: list[torch.nn.Module], rows: int, device: torch.device, calls: int) -> float:
    x = torch.randn(rows, pool[0].in_features, device=device, dtype=torch.bfloat16)
    for m in pool:  # the first call of an Int4Linear on CUDA packs its weight for the kernel
        m(x)
    times = []
    for i in range(calls):
        m = pool[i % len(pool)]
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            m(x)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            import time

            t = time.perf_counter()
            m(x)
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", default="bf16,int4_g32,blockq_q4_k")
    parser.add_argument("--shapes", default="w13,w2,lm_head")
    parser.add_argument("--pool-mb", type=int, default=512)
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: every variant runs once")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --smoke)")
    device = torch.device("cpu" if args.smoke else "cuda")
    g = torch.Generator().manual_seed(0)
    bw = copy_bandwidth(device) if device.type == "cuda" else float("nan")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke)"
    print(f"device: {name}; copy bandwidth {bw / 1e9:.0f} GB/s (read + write)")
    print(f"{'kind':<12} {'shape':<14} {'MB':>7} {'1 row us':>9} {'16 rows us':>10} {'GB/s @1':>8} {'of bw':>6} "
          f"{'16/1':>6}")
    results = []
    for kind in args.kinds.split(","):
        for shape in args.shapes.split(","):
            N, K = (256, 512) if args.smoke else SHAPES[shape]
            first = modules(kind, N, K, g, device)
            copies = 1 if args.smoke else max(1, args.pool_mb * 2**20 // weight_bytes(first))
            pool = [first] + [modules(kind, N, K, g, device) for _ in range(copies - 1)]
            calls = 2 if args.smoke else args.calls
            one, sixteen = (time_calls(pool, r, device, calls) for r in (1, 16))
            rate = weight_bytes(first) / one
            print(f"{kind:<12} {f'{N}x{K}':<14} {weight_bytes(first) / 1e6:7.1f} {one * 1e6:9.1f} "
                  f"{sixteen * 1e6:10.1f} {rate / 1e9:8.0f} {rate / bw:6.0%} {sixteen / one:6.2f}")
            results.append({"kind": kind, "shape": [N, K], "bytes": weight_bytes(first), "s_1": one,
                            "s_16": sixteen, "bandwidth_fraction": rate / bw})
            del pool
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "copy_bandwidth": bw, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
