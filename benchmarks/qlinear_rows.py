"""Block-quantized linears on the CPU: bandwidth at one row, cost of 8- and 16-row calls.

    python benchmarks/qlinear_rows.py                       # every format, qwen2.5-coder-1.5b shapes
    python benchmarks/qlinear_rows.py --rows 1,2,4,8,16 --formats q4_k,q6_k --isa amx

What it prints, per format (the GGUF types the catalogue's files hold, and `quant`'s INT4 / INT8):
milliseconds per call of a real-shaped weight at 1, 8 and 16 rows (random codes and scales; best of
`--passes` passes over the pool), the
weight bytes read per second at one row as a fraction of the machine's measured read bandwidth,
and the 8- and 16-row cost relative to one row. The bandwidth is `cpu_blockq.ops().read_probe`
(AVX-512 loads of a 1 GiB buffer on every thread, best of 5), measured again before every format
and shape: on a shared VM it moves by 2x within minutes. Each timed call reads a different
copy of the weight, from a pool of at least `--pool-mb`, so the weights come from DRAM as in a
model's decode step, not from the last-level cache. Write the CPU (printed first) next to the figures.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from runtime.blockq import BlockQuantLinear
from runtime.hardware import cpu_summary
from runtime.kernels import cpu_blockq

# name -> (bits, group, super-block, mins share the scales' codes); what each GGUF type / quant module
# becomes (runtime.gguf_blocks, BlockQuantLinear.from_int4 / from_int8)
FORMATS = {
    "q4_k": (4, 32, 256, False), "q6_k": (6, 16, 256, True), "q8_0": (8, 32, 32, True), "q5_0": (5, 32, 32, True),
    "q4_1": (4, 32, 32, True), "int4_g128": (4, 32, 128, True), "int8": (8, 32, 32, True),
}
SHAPES = {"w13": (17920, 1536), "w2": (1536, 8960)}  # qwen2.5-coder-1.5b: gate/up fused, down


def random_module(fmt: str, N: int, K: int, g: torch.Generator) -> BlockQuantLinear:
    bits, G, S, shared = FORMATS[fmt]
    q = torch.randint(0, 1 << bits, (N, K), generator=g, dtype=torch.uint8)
    sc = torch.randint(1, 64, (N, K // G), generator=g).to(torch.int8)
    mc = sc if shared else torch.randint(0, 64, (N, K // G), generator=g).to(torch.int8)
    d, dm = torch.rand(N, K // S, generator=g) * 1e-3, torch.rand(N, K // S, generator=g) * 1e-3
    return BlockQuantLinear.from_canonical(q, sc, mc, d, dm, bits, G, S)


def time_rows(pool: list[BlockQuantLinear], rows: int, dtype: torch.dtype, isa: str, passes: int) -> float:
    """Seconds per call with `rows` rows: the best of `passes` passes over the whole pool (one call
    per module, so every call reads its weight from DRAM), divided by the pool's size."""
    x = torch.randn(rows, pool[0].in_features, dtype=torch.float32).to(dtype)

    def call(m: BlockQuantLinear) -> None:
        cpu_blockq.blockq_mm(x, m.codes, m.sc, m.mc, m.d, m.dm, None, m.bits, m.group_size, m.super_block, isa=isa)

    call(pool[0])
    best = float("inf")
    for _ in range(passes):
        t = time.perf_counter()
        for m in pool:
            call(m)
        best = min(best, (time.perf_counter() - t) / len(pool))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", default=",".join(FORMATS), help="comma-separated, of: " + ", ".join(FORMATS))
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated, of: " + ", ".join(SHAPES))
    parser.add_argument("--rows", default="1,8,16", help="row counts to time (the first is the reference)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--isa", default="auto", choices=list(cpu_blockq.ISAS), help="kernel path (auto: by rows)")
    parser.add_argument("--pool-mb", type=int, default=768, help="weights cycled through per format and shape")
    parser.add_argument("--passes", type=int, default=3, help="passes over the pool per row count (best is kept)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not cpu_blockq.available():
        raise SystemExit(f"the block-quantized kernels are unavailable: {cpu_blockq.unavailable_reason()}")
    dtype = getattr(torch, args.dtype)
    rows = [int(r) for r in args.rows.split(",")]
    cpu = cpu_summary()
    probe = torch.ones(1 << 30, dtype=torch.uint8)
    print(f"CPU: {cpu['model']}, {torch.get_num_threads()} threads, flags {' '.join(cpu['flags'])}; kernel paths "
          f"{', '.join(cpu_blockq.isas())}")
    g = torch.Generator().manual_seed(0)
    results = []
    header = f"{'format':<10} {'shape':<11} {'MB':>6} " + " ".join(f"{f'{r} row ms':>10}" for r in rows)
    print(header + f" {'GB/s @1':>8} {'bw':>6} {'of bw':>6} " + " ".join(f"{f'{r}/{rows[0]}':>6}" for r in rows[1:]))
    for fmt in args.formats.split(","):
        for shape_name in args.shapes.split(","):
            N, K = SHAPES[shape_name]
            first = random_module(fmt, N, K, g)
            pool = [first] + [random_module(fmt, N, K, g)
                              for _ in range(max(0, args.pool_mb * 2**20 // first.nbytes() - 1))]
            bw = cpu_blockq.read_bandwidth(probe)
            ms = {r: time_rows(pool, r, dtype, args.isa, args.passes) * 1e3 for r in rows}
            rate = first.nbytes() / (ms[rows[0]] / 1e3)
            ratios = " ".join(f"{ms[r] / ms[rows[0]]:6.2f}" for r in rows[1:])
            print(f"{fmt:<10} {f'{N}x{K}':<11} {first.nbytes() / 1e6:6.1f} " + " ".join(f"{ms[r]:10.3f}" for r in rows)
                  + f" {rate / 1e9:8.1f} {bw / 1e9:6.1f} {rate / bw:6.0%} {ratios}")
            results.append({"format": fmt, "shape": [N, K], "bytes": first.nbytes(), "ms": ms,
                            "read_bandwidth": bw, "bandwidth_fraction": rate / bw})
            del pool
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu, "dtype": args.dtype, "isa": args.isa, "results": results},
                      f, indent=2)


if __name__ == "__main__":
    main()
