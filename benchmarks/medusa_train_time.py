"""Train Medusa heads on an existing hidden-state cache for a fixed number of minutes.

Compares training settings at equal time on the same data (BENCHMARKS.md section 4), e.g. greedy
against soft targets on the cache of a finished recipe run:

    python benchmarks/medusa_train_time.py --cache runs/medusa_smollm2_s5_60/hidden_cache --out runs/a --minutes 18
    python benchmarks/medusa_train_time.py --cache runs/medusa_smollm2_s5_60/hidden_cache --out runs/b --minutes 18 --soft-targets
    python recipes/medusa_smollm2.py --out runs/a --eval-only --eval-dtype float32 --speed-prompts 0

The training settings default to recipes/medusa_smollm2.py's (two residual layers per head, 3
epochs, batch 512, lr 2e-3, 20 warm-up steps, data vocabulary, 64-node tree); the flags change
the ones that A/B runs compare.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import distill
import runtime
from distill.train_medusa import TrainConfig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", required=True, help="hidden-state cache directory (distill.cache_hidden_states)")
    p.add_argument("--out", required=True, help="directory for the heads")
    p.add_argument("--minutes", type=float, required=True, help="training time (the cosine schedule follows it)")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--soft-targets", action="store_true")
    p.add_argument("--num-layers", type=int, default=2, help="residual layers per head")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--feature-noise", type=float, default=0.0, help="TrainConfig.feature_noise")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = runtime.load_model(args.model, dtype=torch.bfloat16)
    heads = distill.attach_medusa(model, num_heads=4, num_layers=args.num_layers)
    cfg = TrainConfig(epochs=args.epochs, lr=2e-3, batch_size=512, vocab="data", tree_nodes=64, warmup_steps=20,
                      checkpoint_every=100, soft_targets=args.soft_targets, feature_noise=args.feature_noise)
    m = distill.train_medusa(heads, args.cache, args.out, cfg, deadline=time.monotonic() + 60 * args.minutes,
                             resume=False)  # a fresh start every time: equal-time comparisons
    print(json.dumps({k: m[k] for k in ("steps", "planned_steps", "top1_accuracy", "expected_accepted_per_step")}))


if __name__ == "__main__":
    main()
