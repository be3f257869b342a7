"""The ceiling of a 4-bit decode step on the machine at hand, and what verifying more rows costs.

    python benchmarks/step_ceiling.py                                   # the 1.5B target, its GGUF blocks
    python benchmarks/step_ceiling.py --model smollm2-135m-instruct --isa avx2 --json step.json
    python benchmarks/step_ceiling.py --against-8bit          # 6-bit codes (Q6_K) against the same as 8-bit
    python benchmarks/step_ceiling.py --prefill 512,2048      # also prefill tokens/s (llama-bench's pp512, pp2048)
    python benchmarks/step_ceiling.py --against ~/.cache/specdec/kernels/cpu_blockq-<hash>-<checkout>

Loads the model with `weights="gguf"` and calls every block-quantized linear a decode step runs
(each layer's fused qkv, output, gate/up and down projections, then the LM head; the embedding is a
lookup, not counted) in order, with bf16 activations of 1, 2, 4, 8 and 16 rows. The step's weights
(0.99 GB for the 1.5B) are far larger than the caches, so each step reads them from memory as
decoding does. Row counts alternate within each repeat (drift of a shared machine hits them
alike); medians over `--repeats`. Printed: the CPU and its kernel paths, the read bandwidth
(`read_probe`: AVX-512 or AVX2 loads of 1 GiB on every thread, best of 5, measured before and after),
the 1-row step in ms and as a fraction of that bandwidth, and each row count's cost over one row,
the price of verifying a block of that many tokens, in one line:

    read 41.2 GB/s | 1 row 31.0 ms = 37.0 GB/s (90%) | rows 2/4/8/16: 1.04/1.18/1.63/2.71x
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from attention_rows import other_build

import runtime
from runtime.argtypes import positive_int
from runtime.atomic import atomic_write_text
from runtime.blockq import BlockQuantLinear
from runtime.hardware import cpu_summary
from runtime.kernels import cpu_blockq
from specdec.rows import prefill


def step_linears(model: torch.nn.Module) -> list[BlockQuantLinear]:
    """The block-quantized linears one decode step multiplies, in the order it runs them."""
    return [m for name, m in model.named_modules() if isinstance(m, BlockQuantLinear) and not name.startswith("embed")]


def time_step(linears: list[BlockQuantLinear], rows: int, isa: str, g: torch.Generator, ops=None) -> float:
    """Seconds for one pass over `linears` with `rows` rows of bf16 activations (through the op of `ops`,
    another build's, when given)."""
    xs = {k: torch.randn(rows, k, generator=g).to(torch.bfloat16) for k in {m.in_features for m in linears}}
    ops = ops or cpu_blockq.ops()
    t = time.perf_counter()
    for m in linears:
        ops.blockq_mm(xs[m.in_features], m.codes, m.sc, m.mc, m.d, m.dm, m.bias, m.bits, m.group_size,
                      m.super_block, m.zero, cpu_blockq.ISAS[isa], cpu_blockq.AMX_MIN_ROWS)
    return time.perf_counter() - t


def as_8bit(m: BlockQuantLinear) -> BlockQuantLinear:
    """`m` with 6-bit codes stored as 8-bit ones (the same weights; others as they are)."""
    if m.bits != 6:
        return m
    q, sc, mc, d, dm = m.canonical()
    return BlockQuantLinear.from_canonical(q, sc, mc, d, dm, 8, m.group_size, m.super_block, m.bias)


def time_prefills(model: torch.nn.Module, lengths: list[int], against_8bit: bool,
                  g: torch.Generator) -> dict[str, dict[int, float]]:
    """Median tokens/s of 3 eager prefills of random prompts of each length (the 6-bit codes' modules
    swapped for 8-bit ones in turn with `against_8bit`); prints one line per length."""
    six = {n: m for n, m in model.named_modules() if isinstance(m, BlockQuantLinear) and m.bits == 6}
    kinds = {"as loaded": six, **({"6-bit codes as 8-bit": {n: as_8bit(m) for n, m in six.items()}}
                                  if against_8bit and six else {})}
    rates: dict[str, dict[int, float]] = {k: {} for k in kinds}
    for T in lengths:
        print(f"timing {3 * len(kinds)} prefills of {T} tokens...", flush=True)
        runs: dict[str, list[float]] = {k: [] for k in kinds}
        for i in range(3):
            for kind in (list(kinds) if i % 2 == 0 else list(kinds)[::-1]):
                for name, module in kinds[kind].items():
                    model.set_submodule(name, module)
                ids = torch.randint(0, model.config.vocab_size, (T,), generator=g)
                cache = model.new_cache(1, T + 1)
                t = time.perf_counter()
                with torch.inference_mode():
                    prefill(model, [ids], cache)
                runs[kind].append(T / (time.perf_counter() - t))
        for kind in kinds:
            rates[kind][T] = statistics.median(runs[kind])
        print(f"prefill {T} tokens: " + ", ".join(f"{rates[k][T]:.1f} tok/s ({k})" for k in kinds))
    for name, module in six.items():
        model.set_submodule(name, module)
    return rates


def row_counts(text: str) -> list[int]:
    """An argparse `type`: comma-separated row counts, each an integer >= 1 ("1,2,4")."""
    try:
        return [positive_int(part.strip()) for part in text.split(",")]
    except argparse.ArgumentTypeError as err:
        raise argparse.ArgumentTypeError(f"row counts are integers >= 1 joined by commas (e.g. 1,2,4): {err}") from None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="catalogue name, .gguf file")
    parser.add_argument("--rows", type=row_counts, default="1,2,4,8,16", help="row counts (the first is the reference)")
    parser.add_argument("--isa", default="auto", choices=list(cpu_blockq.ISAS), help="kernel path (auto: by rows)")
    parser.add_argument("--repeats", type=positive_int, default=7, help="steps per row count (median)")
    parser.add_argument("--threads", type=positive_int, default=None)
    parser.add_argument("--against-8bit", action="store_true",
                        help="also time the step with its 6-bit codes (Q6_K) stored as 8-bit ones, alternating in this "
                             "process, and print the 6-bit step's cost over that one per row count")
    parser.add_argument("--prefill", type=row_counts, default=None,
                        help="also time the eager prefill of random prompts of these lengths (tokens/s, median of 3; "
                             "with --against-8bit, alternating)")
    parser.add_argument("--against", type=Path, default=None,
                        help="another checkout's kernel build directory (~/.cache/specdec/kernels/cpu_blockq-<hash>-"
                             "<checkout>): also time the step with its library, alternating, and print this build's "
                             "time over that one's per row count")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not cpu_blockq.available():
        raise SystemExit(f"the block-quantized kernels are unavailable: {cpu_blockq.unavailable_reason()}")
    other = other_build(args.against, "blockq_mm") if args.against is not None else None
    rows = args.rows
    model = runtime.load_model(args.model, dtype=torch.bfloat16, weights="gguf")
    linears = step_linears(model)
    nbytes = sum(m.nbytes() for m in linears)
    cpu = cpu_summary()
    print(f"CPU: {cpu['model']}, {torch.get_num_threads()} threads, flags {' '.join(cpu['flags'])}; kernel paths "
          f"{', '.join(cpu_blockq.isas())}; {args.model}: {len(linears)} linears, {nbytes / 1e9:.3f} GB a step")
    probe = torch.ones(1 << 30, dtype=torch.uint8)
    bw_before = cpu_blockq.read_bandwidth(probe)
    g = torch.Generator().manual_seed(0)
    wide = [as_8bit(m) for m in linears] if args.against_8bit else None
    for r in rows:  # warm-up: first calls of each shape
        time_step(linears, r, args.isa, g)
        if wide:
            time_step(wide, r, args.isa, g)
        if other:
            time_step(linears, r, args.isa, g, other)
    times: dict[int, list[float]] = {r: [] for r in rows}
    wide_times: dict[int, list[float]] = {r: [] for r in rows}
    other_times: dict[int, list[float]] = {r: [] for r in rows}
    for i in range(args.repeats):
        for r in (rows if i % 2 == 0 else rows[::-1]):
            if other and i % 2:
                other_times[r].append(time_step(linears, r, args.isa, g, other))
            times[r].append(time_step(linears, r, args.isa, g))
            if wide:
                wide_times[r].append(time_step(wide, r, args.isa, g))
            if other and not i % 2:
                other_times[r].append(time_step(linears, r, args.isa, g, other))
    bw = max(bw_before, cpu_blockq.read_bandwidth(probe))
    ms = {r: statistics.median(t) * 1e3 for r, t in times.items()}
    rate = nbytes / (ms[rows[0]] / 1e3)
    ratios = {r: ms[r] / ms[rows[0]] for r in rows[1:]}
    more = f" | rows {'/'.join(map(str, rows[1:]))}: {'/'.join(f'{v:.2f}' for v in ratios.values())}x" if ratios else ""
    print(f"read {bw / 1e9:.1f} GB/s | {rows[0]} row {ms[rows[0]]:.1f} ms = {rate / 1e9:.1f} GB/s "
          f"({rate / bw:.0%}){more}")
    against = {r: statistics.median(times[r]) / statistics.median(wide_times[r]) for r in rows} if wide else None
    if wide:
        print(f"6-bit codes against 8-bit ones ({sum(m.nbytes() for m in wide) / 1e9:.3f} GB a step), rows "
              f"{'/'.join(map(str, rows))}: {'/'.join(f'{v:.3f}' for v in against.values())}x")
    against_build = {r: statistics.median(times[r]) / statistics.median(other_times[r]) for r in rows} if other \
        else None
    if other:
        print(f"this build against {args.against.name}, rows {'/'.join(map(str, rows))}: "
              f"{'/'.join(f'{v:.3f}' for v in against_build.values())}x the time")
    prefill_rates = time_prefills(model, args.prefill, args.against_8bit, g) if args.prefill else None
    if args.json:
        atomic_write_text(args.json, json.dumps({
            "cpu": cpu, "model": args.model, "isa": args.isa, "threads": torch.get_num_threads(), "step_bytes": nbytes,
            "read_bandwidth": bw, "ms": ms, "bandwidth_fraction": rate / bw, "ratios": ratios,
            "against_8bit": against,
            "against_build": against_build and {"build": str(args.against), "ratios": against_build},
            "prefill_tokens_per_s": prefill_rates}, indent=2) + "\n")


if __name__ == "__main__":
    from runtime.errors import SpecdecError

    try:
        main()
    except SpecdecError as err:  # a model that cannot be loaded: one line, as the arguments' errors
        raise SystemExit(f"step_ceiling.py: error: {' '.join(str(err).split())}") from None
