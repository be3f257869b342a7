"""Train Medusa heads on an existing hidden-state cache for a fixed number of minutes.

Compares training settings at equal time on the same data (BENCHMARKS.md section 5), e.g. greedy
against soft targets on the cache of a finished recipe run:

    python benchmarks/medusa_train_time.py --cache runs/medusa_smollm2/hidden_cache --out runs/a --minutes 18
    python benchmarks/medusa_train_time.py --cache runs/medusa_smollm2/hidden_cache --out runs/b --minutes 18 \
        --soft-targets
    python recipes/medusa_smollm2.py --out runs/a --eval-only --eval-dtype float32 --speed-prompts 0

The training flags are MedusaTrainConfig's (`distill.config_args`) with recipes/medusa_smollm2.py's
values (its TRAIN, two residual layers per head), so a run changes only what an A/B run compares.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import distill
import runtime
from distill.config_args import add_dataclass_args, dataclass_from_args
from distill.medusa.train import MedusaTrainConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))
from medusa_smollm2 import DEFAULTS, TRAIN  # noqa: E402  (a script beside this one, not a package)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", required=True, help="hidden-state cache directory (distill.cache_hidden_states)")
    p.add_argument("--out", required=True, help="directory for the heads")
    p.add_argument("--minutes", type=float, required=True, help="training time (the cosine schedule follows it)")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--num-layers", type=int, default=DEFAULTS["num_layers"], help="residual layers per head")
    p.add_argument("--threads", type=int, default=2)
    add_dataclass_args(p.add_argument_group("head training (MedusaTrainConfig)"), MedusaTrainConfig, defaults=TRAIN)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = runtime.load_model(args.model, dtype=torch.bfloat16, weights="dense")
    heads = distill.attach_medusa(model, num_heads=4, num_layers=args.num_layers)
    cfg = dataclass_from_args(MedusaTrainConfig, args)
    m = distill.train_medusa(heads, args.cache, args.out, cfg, deadline=time.monotonic() + 60 * args.minutes,
                             resume=False)  # a fresh start every time: equal-time comparisons
    print(json.dumps({k: m[k] for k in ("steps", "planned_steps", "top1_accuracy", "expected_accepted_per_step")}))


if __name__ == "__main__":
    main()
