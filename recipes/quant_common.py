"""Shared steps of the quant_* / compress_* recipes: compress, save, report perplexity and size, run `specdec eval`.

Default output root: $SPECDEC_HOME/compressed (default ~/.cache/specdec/compressed). The root holds
one directory per checkpoint and the recipes' JSON summaries; `check_outputs` checks every one of
them before any work (runtime.output_paths' rule: a checkpoint directory is new, empty, or with
--overwrite a checkpoint of an earlier run; nothing else is ever replaced).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

import quant
import runtime
from quant.checkpoint import check_compressed_out
from runtime.argtypes import path_arg
from runtime.atomic import atomic_write_text
from runtime.catalogue import cache_home
from runtime.output_paths import OutputPathError, check_output_file


def recipe_args(description: str, calib_source: str = "sharegpt") -> argparse.Namespace:
    """The options every draft recipe takes (output dir, calibration text and sizes, evaluation
    sizes, eval step); `calib_source` is the recipe's default calibration text."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--out", type=path_arg, default=compressed_home(), help="where compressed checkpoints go")
    add_calib_source(ap, calib_source)
    ap.add_argument("--n-calib", type=int, default=64, help="calibration windows")
    ap.add_argument("--n-eval", type=int, default=16, help="perplexity windows per text set")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--eval-limit", type=int, default=20, help="HumanEval prompts for specdec eval")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--skip-eval", action="store_true", help="stop before the specdec eval step")
    add_overwrite(ap)
    return ap.parse_args()


def add_overwrite(ap: argparse.ArgumentParser) -> None:
    """The --overwrite option of every compression recipe."""
    ap.add_argument("--overwrite", action="store_true",
                    help="replace the checkpoints an earlier run of this recipe left in --out (never anything else)")


def _is_rows_json(path: Path) -> bool:
    try:
        return isinstance(json.loads(path.read_text()), list)
    except (OSError, ValueError):
        return False


def check_outputs(root: Path, checkpoints: list[Path], summary: Path, overwrite: bool) -> None:
    """Fail now, before any work, when the recipe could not write its outputs: `root` a file, a
    checkpoint directory that is not new, empty or (with `overwrite`) a compressed checkpoint, or a
    summary path that holds something other than a recipe's JSON rows."""
    root = root.expanduser()
    if root.exists() and not root.is_dir():
        raise OutputPathError(f"{root} exists and is not a directory; --out is the directory that receives the "
                              "checkpoints: choose a directory path")
    for ckpt in checkpoints:
        check_compressed_out(ckpt, overwrite)
    check_output_file(summary, what="recipe summary (JSON rows)", looks_like=_is_rows_json)


def write_summary(path: Path, rows: list[dict]) -> None:
    """The recipe's rows as JSON, written atomically."""
    atomic_write_text(path, json.dumps(rows, indent=1))


def add_calib_source(ap: argparse.ArgumentParser, default: str) -> None:
    """The --calib-source option of every compression recipe."""
    ap.add_argument("--calib-source", default=default, choices=["sharegpt", "code", "sharegpt+code"],
                    help="calibration text (quant.calibration_batches): ShareGPT calibration turns, "
                         "site-packages Python (never the stdlib files perplexity scores), or half each")


def compressed_home() -> Path:
    """$SPECDEC_HOME/compressed, through the catalogue's reading of SPECDEC_HOME (and its check)."""
    return cache_home() / "compressed"


def eval_windows(tok, n_eval: int, seq_len: int) -> dict[str, torch.Tensor]:
    """Held-out ShareGPT and stdlib perplexity windows (never overlapping the calibration slice)."""
    return {src: quant.eval_batches(tok, src, n_samples=n_eval, seq_len=seq_len) for src in ("sharegpt", "stdlib")}


def report(name: str, model, evals: dict[str, torch.Tensor], ckpt: Path | None, seconds: float) -> dict:
    """Perplexity on both sets and sizes (memory, disk) of one model; printed as one JSON line."""
    row = {"name": name, "compress_s": round(seconds, 1), "mib_in_memory": round(quant.model_nbytes(model) / 2**20, 1)}
    if ckpt is not None:
        row["mib_on_disk"] = round(quant.dir_nbytes(ckpt) / 2**20, 1)
        row["path"] = str(ckpt)
    for src, windows in evals.items():
        row[f"ppl_{src}"] = round(quant.perplexity(model, windows, progress=True), 4)
    print(json.dumps(row), flush=True)
    return row


def compress_and_save(model_name: str, steps: list, calibration: torch.Tensor | None, out: Path, tok,
                      evals: dict[str, torch.Tensor], overwrite: bool = False) -> dict:
    """Load `model_name` in bf16, apply the configs in order, save to `out` (a checkpoint already
    there replaced only with `overwrite`), report."""
    model = runtime.load_model(model_name, dtype=torch.bfloat16, weights="dense")
    t0 = time.perf_counter()
    quant.apply_recipe(model, quant.Recipe(tuple(steps)), calibration)
    took = time.perf_counter() - t0
    quant.save_compressed(model, out, tokenizer=tok, overwrite=overwrite)
    return report(out.name, model, evals, out, took)


def specdec_eval(target: str, methods: list[str], out: Path, limit: int, max_new_tokens: int) -> int:
    """Run `specdec eval` in a subprocess (tau and tokens/s of each draft on HumanEval prompts)."""
    cmd = [sys.executable, "-m", "specdec.cli", "eval", "--target", target, "--methods", ",".join(methods),
           "--dataset", "humaneval", "--limit", str(limit), "--max-new-tokens", str(max_new_tokens),
           "--out", str(out)]
    print("+", shlex.join(cmd), flush=True)
    return subprocess.run(cmd).returncode
