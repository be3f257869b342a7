"""`specdec bench`: plain-decoding speed of this runtime against transformers, and the bandwidth ceiling.

Both runtimes decode the same HumanEval prompts (the first N, raw completions) with the same
checkpoint, dtype and `max_new_tokens`, alternating per prompt (and which goes first), after
warm-up. eos is ignored so that both generate exactly `max_new_tokens` per prompt; tokens/s per
prompt = new tokens / wall seconds of the whole call (prefill included); medians over prompts.

Decoding one token reads every weight once, so tokens/s is bounded by
bandwidth / weight bytes per token. Weight bytes per token = every tensor of the decoder layers,
the final norm and the lm_head (the embedding lookup reads one row: not counted; a tied lm_head
counts once), in the model's dtype (KV-cache reads are left out: small at these lengths).
Bandwidth is measured two ways: (1) a matrix-vector product with an N x N weight in the model's
dtype (bytes = weight bytes), (2) a float32 `x.sum()` over a tensor much larger than the caches;
the median of repeats each. The fraction of each ceiling that each runtime reaches is reported.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

import runtime
from runtime.atomic import atomic_write_text
from runtime.cache import available_memory
from runtime.hardware import check_device
from runtime.loading import WEIGHTS
from runtime.output_paths import check_output_file
from runtime.progress import progress as progress_bar
from specdec.evaluation.baselines import HFGenerator, load_hf_model
from specdec.evaluation.evaluate import DTYPES, command_line, versions
from specdec.evaluation.prompts import humaneval_prompts
from specdec.generate import generate
from specdec.options import WEIGHTS_HELP


@dataclass(frozen=True)
class BenchConfig:
    """Settings of one benchmark run (the CLI's defaults are these)."""

    model: str = "qwen2.5-coder-1.5b-instruct"
    dtype: str = "bfloat16"
    device: str = "cpu"
    prompts: int = 10
    max_new_tokens: int = 128
    warmup: int = 1
    matvec_size: int = 8192
    stream_mib: int = 1024
    repeats: int = 20
    threads: int | None = None
    compile: bool = False
    weights: str = "auto"
    json: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        for name in ("prompts", "max_new_tokens", "matvec_size", "stream_mib", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.prompts > 164:
            raise ValueError(f"HumanEval has 164 prompts, asked for {self.prompts}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1 (or None for torch's default), got {self.threads}")
        if self.weights not in WEIGHTS:
            raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, got {self.weights!r}")


def weight_bytes_per_token(model) -> int:
    """Bytes of weights one decode step reads: decoder layers + final norm + lm_head, each tensor once."""
    seen: set[int] = set()
    total = 0
    for module in (model.layers, model.norm, model.lm_head):
        for t in [*module.parameters(), *module.buffers()]:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    return total


def _median_time(fn, repeats: int, device: str) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.inference_mode()
def matvec_bandwidth(size: int = 8192, dtype: torch.dtype = torch.bfloat16, repeats: int = 20,
                     device: str = "cpu") -> float:
    """Bytes/s of a (1, size) x (size, size)^T product in `dtype`, counting the weight bytes read."""
    gen = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(size, size, generator=gen, device=device).to(dtype)  # (N, N)
    x = torch.randn(1, size, generator=gen, device=device).to(dtype)  # (1, N)
    secs = _median_time(lambda: F.linear(x, w), repeats, device)
    return w.numel() * w.element_size() / secs


@torch.inference_mode()
def stream_bandwidth(mib: int = 1024, repeats: int = 20, device: str = "cpu") -> float:
    """Bytes/s of a float32 x.sum() over a `mib` MiB tensor."""
    x = torch.ones(mib * 2**20 // 4, dtype=torch.float32, device=device)
    secs = _median_time(lambda: x.sum(), repeats, device)
    return x.numel() * 4 / secs


def probe_bytes(cfg: BenchConfig) -> list[tuple[str, int, int, int]]:
    """(option, its value, its default, bytes allocated) of each bandwidth probe: the N x N float32
    draw and its copy in the model's dtype (--matvec-size), the float32 tensor of --stream-mib."""
    elem = DTYPES[cfg.dtype].itemsize
    return [("--matvec-size", cfg.matvec_size, BenchConfig.matvec_size,
             cfg.matvec_size ** 2 * (4 + (elem if elem != 4 else 0))),
            ("--stream-mib", cfg.stream_mib, BenchConfig.stream_mib, cfg.stream_mib * 2**20)]


def check_probe_memory(cfg: BenchConfig) -> None:
    """ValueError, before anything loads, when a bandwidth probe would not fit in the device's free
    memory (host memory for the CPU), naming its option and both sizes."""
    free = available_memory(check_device(cfg.device))
    for flag, value, default, need in probe_bytes(cfg):
        if need > free:
            raise ValueError(f"{flag} {value} needs {need / 2**30:.1f} GiB for its bandwidth probe, but {cfg.device} "
                             f"has {free / 2**30:.1f} GiB free; lower {flag} (default: {default})")


def _is_bench_result(path: Path) -> bool:
    """True for a JSON file `run_bench` wrote (the only kind of file cfg.json replaces)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and {"runtimes", "outputs_match", "speedup_vs_transformers"} <= set(data)


def run_bench(cfg: BenchConfig, command: str | None = None, progress: bool = True) -> dict:
    """Run the benchmark; returns the result dict (written to cfg.json when set: a new file or an
    earlier result, else runtime.output_paths.OutputPathError before any work)."""
    if cfg.json is not None:
        check_output_file(cfg.json, what="bench result JSON", looks_like=_is_bench_result)
    check_probe_memory(cfg)
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    dtype = DTYPES[cfg.dtype]
    tok = runtime.load_tokenizer(cfg.model)
    prompts = [list(tok(p.turns[0])["input_ids"]) for p in humaneval_prompts()[:cfg.prompts]]
    ours = runtime.load_model(cfg.model, dtype=dtype, device=cfg.device, weights=cfg.weights)
    compiled = (runtime.load_model(cfg.model, dtype=dtype, device=cfg.device, compile=True, weights=cfg.weights)
                if cfg.compile else None)
    # a list, so the transformers model can be freed before the bandwidth measurements
    theirs = [HFGenerator(load_hf_model(cfg.model, dtype, cfg.device, eos_token_id=None,
                                        pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else 0))]

    def ours_on(model):
        def run(ids: list[int]) -> list[int]:
            out = generate(model, [torch.tensor(ids)], max_new_tokens=cfg.max_new_tokens)
            return out.sequences[0][len(ids):].tolist()
        return run

    def run_theirs(ids: list[int]) -> list[int]:
        return theirs[0].generate(ids, cfg.max_new_tokens)

    runners = {"specdec": ours_on(ours), "transformers": run_theirs}
    if compiled is not None:
        runners["specdec-compiled"] = ours_on(compiled)
    start = time.perf_counter()
    for _ in range(max(cfg.warmup, 1 if compiled is not None else 0)):  # compiling is not timed
        for fn in runners.values():
            fn(prompts[0])
    warmup_s = time.perf_counter() - start
    tps: dict[str, list[float]] = {k: [] for k in runners}
    outputs: dict[str, list[list[int]]] = {k: [] for k in runners}
    order = list(runners)
    for i, ids in enumerate(progress_bar(prompts, desc="bench", unit="prompt", disable=not progress)):
        for name in order[i % len(order):] + order[:i % len(order)]:  # each runtime goes first in turn
            start = time.perf_counter()
            new = runners[name](ids)
            tps[name].append(len(new) / (time.perf_counter() - start))
            outputs[name].append(new)
    theirs.clear()
    bytes_per_token = weight_bytes_per_token(ours)
    bw = {"matvec": matvec_bandwidth(cfg.matvec_size, dtype, cfg.repeats, cfg.device),
          "stream": stream_bandwidth(cfg.stream_mib, cfg.repeats, cfg.device)}
    ceiling = {k: v / bytes_per_token for k, v in bw.items()}
    result = {
        "command": command if command is not None else command_line("bench", cfg),
        "versions": versions(),
        "settings": dataclasses.asdict(cfg),
        "warmup_s": warmup_s,
        "weight_bytes_per_token": bytes_per_token,
        "bandwidth_bytes_per_s": bw,
        "ceiling_tokens_per_second": ceiling,
        "runtimes": {name: {"tokens_per_second": statistics.median(v), "per_prompt_tokens_per_second": v,
                            "new_tokens": sum(len(o) for o in outputs[name]),
                            **{f"fraction_of_{k}_ceiling": statistics.median(v) / c for k, c in ceiling.items()}}
                     for name, v in tps.items()},
        "outputs_match": _match(outputs["specdec"], outputs["transformers"]),
        "outputs_match_by_runtime": {name: _match(outputs[name], outputs["transformers"]) for name in runners},
    }
    result["speedup_vs_transformers"] = (result["runtimes"]["specdec"]["tokens_per_second"]
                                         / result["runtimes"]["transformers"]["tokens_per_second"])
    if cfg.json is not None:
        atomic_write_text(cfg.json, json.dumps(result, indent=2) + "\n")
    return result


def _match(ours: list[list[int]], theirs: list[list[int]]) -> float:
    """Fraction of prompts whose new tokens are identical."""
    return sum(a == b for a, b in zip(ours, theirs)) / len(theirs)


LABELS = {"specdec": "specdec (this runtime)", "specdec-compiled": "specdec, `--compile` (torch.compile)",
          "transformers": "transformers generate()"}


def format_table(result: dict) -> str:
    """A Markdown section for BENCHMARKS.md: the command, the table, the ceiling inputs."""
    s, r, c = result["settings"], result["runtimes"], result["ceiling_tokens_per_second"]
    bw = result["bandwidth_bytes_per_s"]
    v = result["versions"]
    lines = [f"#### {s['model']}, {s['dtype']}, {s['device']}", "",
             f"Command: `{result['command']}`", "",
             f"| runtime | tok/s (median) | vs transformers | of matvec ceiling ({c['matvec']:.1f} tok/s) "
             f"| of stream ceiling ({c['stream']:.1f} tok/s) | outputs equal to transformers |",
             "|---|---:|---:|---:|---:|---:|"]
    base = r["transformers"]["tokens_per_second"]
    match = result["outputs_match_by_runtime"]
    for name, g in r.items():
        lines.append(f"| {LABELS.get(name, name)} | {g['tokens_per_second']:.1f} | "
                     f"{g['tokens_per_second'] / base:.2f}x | "
                     f"{100 * g['fraction_of_matvec_ceiling']:.0f}% | {100 * g['fraction_of_stream_ceiling']:.0f}% "
                     f"| {100 * match[name]:.0f}% |")
    lines += ["",
              f"{s['prompts']} HumanEval prompts (raw), {s['max_new_tokens']} new tokens each (eos ignored), "
              f"median over prompts, runtimes alternating, {s['warmup']} warm-up. Weights read per token: "
              f"{result['weight_bytes_per_token'] / 1e9:.3f} GB; bandwidth: matvec "
              f"{bw['matvec'] / 1e9:.1f} GB/s ({s['matvec_size']}x{s['matvec_size']} {s['dtype']}), "
              f"stream {bw['stream'] / 1e9:.1f} GB/s ({s['stream_mib']} MiB float32 sum). Warm-up (compiling "
              f"included): {result['warmup_s']:.0f} s. torch {v['torch']}, transformers "
              f"{v['transformers']}, {v['cpu_count']} CPUs, {v['torch_threads']} threads.", ""]
    return "\n".join(lines)


def register(subparsers) -> argparse.ArgumentParser:
    """Add the `bench` subcommand to an argparse subparsers object."""
    d = {f.name: f.default for f in dataclasses.fields(BenchConfig)}
    p = subparsers.add_parser("bench", help="plain decoding tokens/s vs transformers and the bandwidth "
                              "ceiling", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=d["model"], help="catalogue name, checkpoint dir, .gguf or hub id "
                   "(default: %(default)s)")
    p.add_argument("--dtype", default=d["dtype"], choices=list(DTYPES), help="(default: %(default)s)")
    p.add_argument("--device", default=d["device"], help="cpu or cuda (default: %(default)s)")
    p.add_argument("--prompts", type=int, default=d["prompts"], help="first N HumanEval prompts "
                   "(default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=d["max_new_tokens"], help="(default: %(default)s)")
    p.add_argument("--warmup", type=int, default=d["warmup"], help="untimed warm-up generations per "
                   "runtime (default: %(default)s)")
    p.add_argument("--matvec-size", type=int, default=d["matvec_size"], help="N of the N x N matrix-vector "
                   "bandwidth probe (default: %(default)s)")
    p.add_argument("--stream-mib", type=int, default=d["stream_mib"], help="MiB of the streaming-sum "
                   "bandwidth probe (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=d["repeats"], help="repeats of each bandwidth probe "
                   "(median) (default: %(default)s)")
    p.add_argument("--threads", type=int, default=d["threads"], help="torch.set_num_threads for the run "
                   "(default: torch's default, one per core; on a CPU shared with other jobs 1 avoids "
                   "OpenMP barrier stalls)")
    p.add_argument("--compile", action="store_true", help="also time this runtime with "
                   "runtime.compile_decode (torch.compile, Inductor) in the same run; "
                   "compiling happens in the untimed warm-up")
    p.add_argument("--weights", default=d["weights"], choices=list(WEIGHTS), help=WEIGHTS_HELP)
    p.add_argument("--json", default=d["json"], help="also write the full result to this JSON file")
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace) -> int:
    """Entry point of `specdec bench`: runs and prints the Markdown table."""
    names = {f.name for f in dataclasses.fields(BenchConfig)}
    result = run_bench(BenchConfig(**{k: v for k, v in vars(args).items() if k in names}))
    print(format_table(result))
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="python -m specdec.evaluation.bench")
    register(_parser.add_subparsers(dest="command", required=True))
    _args = _parser.parse_args(["bench", *sys.argv[1:]])
    sys.exit(_args.func(_args))
