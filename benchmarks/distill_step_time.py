"""Seconds per draft-distillation step at the real shapes, on the machine at hand.

    python benchmarks/distill_step_time.py --json distill_steps.json            # on a GPU
    python benchmarks/distill_step_time.py --smoke                              # the script itself, on a CPU

A step of `distill.distill_draft` samples the draft's answers (on-policy, the default), scores
them with the frozen target (no_grad) and trains the draft against those logits. What it costs
depends on the shapes, not on what the weights know, so this runs the real loop on randomly
initialised Qwen2.5-Coder 1.5B (target, bf16) and 0.5B (draft, float32 trained under bf16
autocast) configs over random prompts, where a machine cannot hold the real checkpoints (the lent
GPU machines reach no model hub). One warm-up step, then `--steps` timed steps; recipes/
distill_qwen05_draft.py's step count times this gives the recipe's training time there. The
answers run to `--max-new-tokens` (random weights rarely sample an end of turn), as long as the
real recipe's longest.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import gpu_or_smoke, random_qwen, sync, write_json  # noqa: E402  (a script beside this one)

from distill.draft.train import DistillConfig, distill_draft  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="1.5b", help="target config: 1.5b, 0.5b or tiny (default: %(default)s)")
    p.add_argument("--draft", default="0.5b", help="draft config (default: %(default)s)")
    p.add_argument("--steps", type=int, default=10, help="timed steps (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=DistillConfig.batch_size,
                   help="rows per step (default: %(default)s, DistillConfig's)")
    p.add_argument("--max-new-tokens", type=int, default=DistillConfig.max_new_tokens,
                   help="answer tokens per row (default: %(default)s, DistillConfig's)")
    p.add_argument("--data", default=DistillConfig.data, help="on-policy, target or mixed (default: %(default)s)")
    p.add_argument("--lora", action="store_true", help="train LoRA adapters instead of every weight")
    p.add_argument("--prompt-len", type=int, default=96, help="prompt tokens (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_path", default=None, help="also write the figures to this JSON file")
    p.add_argument("--smoke", action="store_true",
                   help="tiny configs on the CPU: checks the script, times nothing real")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Build the random models, run one warm-up step and --steps timed steps, print (and write --json)."""
    args = parse_args(argv)
    device = gpu_or_smoke(args, "distill_step_time.py times GPU steps",
                          "CPU step times of real checkpoints: recipes/distill_qwen05_draft.py")
    torch.manual_seed(args.seed)  # transformers initialises weights from the global generator
    models = {role: random_qwen(name, dtype, device)[1]
              for role, name, dtype in (("target", args.target, torch.bfloat16), ("draft", args.draft, torch.float32))}
    target, draft = models["target"].eval(), models["draft"]
    vocab = target.config.vocab_size
    gen = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(64)]
    cfg = DistillConfig(data=args.data, lora=args.lora, batch_size=args.batch_size,
                        max_new_tokens=args.max_new_tokens, steps=args.steps + 1, seed=args.seed)
    distill_draft(target, draft, prompts, cfg, stop_after=1)  # warm-up: kernels, allocator (each call builds its
    # own optimizer and Accelerator, so that setup is inside the timed call, spread over its steps)
    sync(device)
    start = time.perf_counter()
    distill_draft(target, draft, prompts, cfg, stop_after=args.steps)
    sync(device)
    step_s = (time.perf_counter() - start) / args.steps
    peak_gb = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None
    where = "CPU (smoke run)" if args.smoke else torch.cuda.get_device_name()
    print(f"\n{where}; torch {torch.__version__}; target {args.target} bf16, draft {args.draft} float32 "
          f"({cfg.autocast_mode(device)} autocast), data {args.data}, {'LoRA' if args.lora else 'full'}; "
          f"{args.batch_size} rows x {args.max_new_tokens} answer tokens, prompt {args.prompt_len}\n")
    peak = "-" if peak_gb is None else f"{peak_gb:.1f}"
    print(f"| seconds per step | peak GPU memory GB |\n|---:|---:|\n| {step_s:.3f} | {peak} |")
    if args.json_path:
        write_json(args.json_path, dict(device=where, torch=torch.__version__, command=" ".join(sys.argv),
                                        target=args.target, draft=args.draft, data=args.data, lora=args.lora,
                                        batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                                        steps=args.steps, seconds_per_step=step_s, peak_gpu_gb=peak_gb))
    return 0


if __name__ == "__main__":
    sys.exit(main())
