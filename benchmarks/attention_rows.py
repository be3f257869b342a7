"""The row-invariant CPU attention (`attention_rows`, what a compiled step and an eager prefill run per
layer on bf16 models) by cache length and query tokens, optionally against another build of the kernels.

    python benchmarks/attention_rows.py                                    # 1.5B heads: 12 query, 2 KV, 128 dims
    python benchmarks/attention_rows.py --against ~/.cache/specdec/kernels/cpu_blockq-<hash>-<checkout>

Times one call per (slots, tokens): random bf16 queries, keys and values, the queries the last `tokens`
of `slots` (a decode step, a verification block; tokens == slots is a prefill's causal attention).
Prints the median microseconds a call and times the model's layers (a step's attention). `--against`
loads the library another checkout built (its `specdec_cpu_blockq.so`, its own op namespace) and
alternates the two per call: the ratio is this checkout's time over that one's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from runtime.argtypes import positive_int
from runtime.hardware import cpu_summary
from runtime.kernels import extension

LIBRARY = f"{extension.LIBRARY}.so"


def counts(text: str) -> list[int]:
    """An argparse `type`: comma-separated integers >= 1."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"integers joined by commas, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"integers >= 1, got {text!r}")
    return values


def other_build(directory: Path, op: str = "attention_rows"):
    """The ops of the library built in `directory` (a `runtime.kernels.extension` build directory), which
    must register `op`."""
    library = directory.expanduser() / LIBRARY
    if not library.is_file():
        raise SystemExit(f"--against: no {LIBRARY} in {directory}; pass a directory under "
                         f"~/.cache/specdec/kernels/ that another checkout built")
    parts = directory.expanduser().resolve().name.split("-")
    if len(parts) < 3 or parts[0] != "cpu_blockq" or len(parts[1]) < 12:
        raise SystemExit(f"--against: {directory} is not a kernel build directory (named cpu_blockq-<hash>-<checkout> "
                         f"under ~/.cache/specdec/kernels/)")
    namespace = f"specdec_cpu_{parts[1][:12]}"
    try:
        torch.ops.load_library(str(library))
    except OSError as err:
        raise SystemExit(f"--against: cannot load {library}: {err}") from None
    ops = getattr(torch.ops, namespace)
    if not hasattr(ops, op):
        raise SystemExit(f"--against: {library} registers no {op} in {namespace}")
    return ops


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slots", type=counts, default="256,1024,2048", help="cache lengths (keys a query sees)")
    parser.add_argument("--tokens", type=counts, default="1,4,8", help="query tokens per call")
    parser.add_argument("--heads", type=counts, default="12,2", help="query heads, KV heads")
    parser.add_argument("--dim", type=positive_int, default=128, help="head dimension")
    parser.add_argument("--layers", type=positive_int, default=28, help="layers a step runs (for the step column)")
    parser.add_argument("--repeats", type=positive_int, default=40, help="calls per shape (median)")
    parser.add_argument("--against", type=Path, default=None, help="another checkout's kernel build directory")
    args = parser.parse_args(argv)
    if not extension.available():
        raise SystemExit(f"the CPU kernels are unavailable here: {extension.unavailable_reason()}")
    hq, hkv = (args.heads + args.heads)[:2]
    builds = {"this": extension.ops()}
    if args.against is not None:
        builds["against"] = other_build(args.against)
    cpu = cpu_summary()
    print(f"CPU: {cpu['model']}, {torch.get_num_threads()} threads, flags {' '.join(cpu['flags'])}; "
          f"heads {hq} / {hkv}, dim {args.dim}, bf16")
    g = torch.Generator().manual_seed(0)
    print("| slots | tokens | us a call | ms a step |" + (" against (us) | ratio |" if len(builds) > 1 else ""))
    print("|---:|---:|---:|---:|" + ("---:|---:|" if len(builds) > 1 else ""))
    for S in args.slots:
        for T in (t for t in args.tokens if t <= S):
            q = torch.randn(1, hq, T, args.dim, generator=g).to(torch.bfloat16)
            k, v = (torch.randn(1, hkv, S, args.dim, generator=g).to(torch.bfloat16) for _ in range(2))
            pre = torch.tensor([S - T])
            times: dict[str, list[float]] = {name: [] for name in builds}
            for r in range(args.repeats):
                for name in (list(builds) if r % 2 == 0 else list(builds)[::-1]):
                    t = time.perf_counter()
                    builds[name].attention_rows(q, k, v, None, pre, 0)
                    times[name].append(time.perf_counter() - t)
            us = {name: statistics.median(ts) * 1e6 for name, ts in times.items()}
            line = f"| {S} | {T} | {us['this']:.0f} | {us['this'] * args.layers / 1e3:.2f} |"
            if "against" in us:
                line += f" {us['against']:.0f} | {us['this'] / us['against']:.2f}x |"
            print(line, flush=True)


if __name__ == "__main__":
    main()
