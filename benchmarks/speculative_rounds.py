"""What one speculative round costs against one plain decoding step, on the machine at hand.

    python benchmarks/speculative_rounds.py --json rounds.json                 # on a GPU
    TRITON_INTERPRET=1 python benchmarks/speculative_rounds.py --smoke          # the script itself, on a CPU

Speed with any drafter is tau / (round / plain step): a round drafts, then the target verifies the
draft in one forward. The round's cost does not depend on what the drafter guesses, so this times
rounds on randomly initialised models with the real Qwen2.5-Coder shapes (the 1.5B target, the
0.5B draft, an EAGLE-3 head with a 32k draft vocabulary), where a machine cannot hold the real
checkpoints (the lent GPU machines reach no model hub). Their drafts are almost never accepted,
so every target forward is one round: ms per target forward = the round's cost. Methods, one
random prompt, batch 1, greedy, best (median) of `--repeats` runs after a warm-up run:

  plain               specdec.generate without a drafter (ms per token = one plain step)
  eagle DxK/N         an EAGLE-3 head, dynamic tree of depth D, top-k K, N nodes verified
  draft kN            the random 0.5B draft, N tokens per round
  transformers        transformers' generate() on the same target weights (the baseline of the
                      4x targets)

For each it reports the round's ms, its draft and verify parts, round / plain step (the tau at
which the method breaks even with plain decoding) and the tau it needs for 4x transformers'
generate(): 4 x round / transformers' ms per token. Acceptance itself (tau) is the draft's
quality and is measured with `specdec eval` on real checkpoints; tau times this ratio gives the
speed the same draft would reach here.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import markdown, qwen_config, sync, write_json  # noqa: E402  (a script beside this one)

import specdec  # noqa: E402
from runtime.attention import default_backend  # noqa: E402
from runtime.loading import from_hf_state  # noqa: E402
from specdec.drafters.eagle import EagleDrafter, EagleTreeConfig  # noqa: E402
from specdec.eagle import Eagle3Config, Eagle3Head  # noqa: E402


def trees(text: str) -> list[EagleTreeConfig]:
    """"5x8/48,8x10/96" -> EagleTreeConfig(depth, top_k, total_tokens) per item."""
    out = []
    for item in text.split(","):
        shape, _, total = item.partition("/")
        depth, _, top_k = shape.partition("x")
        out.append(EagleTreeConfig(depth=int(depth), top_k=int(top_k), total_tokens=int(total)))
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="1.5b", help="target config: 1.5b, 0.5b or tiny (default: %(default)s)")
    p.add_argument("--draft", default="0.5b", help="draft config for the draft rounds (default: %(default)s)")
    p.add_argument("--trees", type=trees, default=trees("5x8/48,6x10/64,8x10/96"),
                   help="EAGLE trees as DEPTHxTOPK/NODES, comma-separated (default: 5x8/48,6x10/64,8x10/96)")
    p.add_argument("--draft-tokens", default="4,6", help="draft-model tokens per round (default: %(default)s)")
    p.add_argument("--draft-vocab", type=int, default=32000, help="EAGLE draft vocabulary (default: %(default)s)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens (default: %(default)s)")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens per timed run (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per method, median (default: %(default)s)")
    p.add_argument("--attention", default=None, help="sdpa or triton (default: the device's default backend)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_path", default=None, help="also write every row to this JSON file")
    p.add_argument("--smoke", action="store_true",
                   help="tiny configs on the CPU: checks the script, times nothing real")
    return p.parse_args(argv)


def timed(fn, device: torch.device, repeats: int) -> tuple[float, object]:
    """Median seconds of fn() over `repeats` runs, and the last run's result."""
    times, out = [], None
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        out = fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def runtime_model(hf, dtype: torch.dtype, device: torch.device, attention: str | None):
    return from_hf_state(hf.state_dict(), hf.config, dtype=dtype, device=device, attention=attention)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import AutoModelForCausalLM

    if args.smoke:
        args.target = args.draft = "tiny"
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        raise SystemExit("speculative_rounds.py times GPU rounds: run it on a CUDA machine, or with --smoke to check "
                         "the script on a CPU (CPU rounds of real checkpoints: benchmarks/medusa_step_cost.py)")
    else:
        device = torch.device("cuda")
    dtype = torch.bfloat16
    torch.manual_seed(args.seed)  # transformers initialises weights from the global generator
    cfg = qwen_config(args.target)
    with device:  # initialised where it runs: a 1.5B model's random init takes tens of seconds on a CPU
        hf = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
        draft_hf = AutoModelForCausalLM.from_config(qwen_config(args.draft), dtype=dtype).eval()
    target = runtime_model(hf, dtype, device, args.attention)
    ids = torch.randint(0, cfg.vocab_size, (1, args.prompt_len), generator=torch.Generator().manual_seed(args.seed))
    n = args.new_tokens
    aux = None if cfg.num_hidden_layers >= 4 else (0, 1, 1)  # the tiny smoke config has 2 layers
    head_cfg = Eagle3Config.from_target(target, draft_vocab_size=min(args.draft_vocab, cfg.vocab_size),
                                        aux_layers=aux, fc_norm=True, norm_output=True)
    head = Eagle3Head(head_cfg).to(device=device, dtype=dtype).eval()
    draft = runtime_model(draft_hf, dtype, device, args.attention)
    del draft_hf

    methods = {"plain": lambda m: specdec.generate(target, ids, max_new_tokens=m)}
    for tree in args.trees:
        methods[f"eagle {tree.depth}x{tree.top_k}/{tree.total_tokens}"] = (
            lambda m, tree=tree: specdec.generate(target, ids, EagleDrafter(head, target, tree), max_new_tokens=m))
    for k in (int(x) for x in args.draft_tokens.split(",") if x):
        methods[f"draft k{k}"] = lambda m, k=k: specdec.generate(target, ids, draft, max_new_tokens=m,
                                                                  num_draft_tokens=k)
    ids_dev = ids.to(device)
    kwargs = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    hf.generate(ids_dev, **{**kwargs, "max_new_tokens": 8, "min_new_tokens": 8})
    hf_seconds, _ = timed(lambda: hf.generate(ids_dev, **kwargs), device, args.repeats)
    hf_ms = 1e3 * hf_seconds / n
    print(f"transformers generate(): {hf_ms:.2f} ms a token", flush=True)
    rows, plain_tokens = [], None
    for name, run in methods.items():
        run(8)  # warm-up: kernel compilation, allocator
        seconds, out = timed(lambda: run(n), device, args.repeats)
        stats = out.stats
        tokens = out.sequences[0, args.prompt_len:].cpu()
        plain_tokens = tokens if name == "plain" else plain_tokens
        rounds = max(stats.target_forwards - 1, 1)  # the prefill is a forward, not a round
        rows.append(dict(method=name, tau=stats.mean_accepted_tokens, round_ms=1e3 * seconds / rounds,
                         draft_ms=1e3 * stats.draft_s / rounds, verify_ms=1e3 * stats.verify_s / rounds,
                         same_as_plain=float((tokens[:plain_tokens.numel()] == plain_tokens[:tokens.numel()])
                                             .float().mean())))
        print(f"{name}: {rows[-1]['round_ms']:.2f} ms a round", flush=True)
    plain_ms = rows[0]["round_ms"]
    for row in rows:
        row["vs_plain_step"] = row["round_ms"] / plain_ms
        row["tau_for_4x_transformers"] = 4 * row["round_ms"] / hf_ms
    rows.append(dict(method="transformers generate()", tau=1.0, round_ms=hf_ms, draft_ms=0.0, verify_ms=hf_ms,
                     same_as_plain=float("nan"), vs_plain_step=hf_ms / plain_ms, tau_for_4x_transformers=4.0))
    where = "CPU (smoke run)" if args.smoke else torch.cuda.get_device_name()
    attention = target.attention or default_backend(device)
    print(f"\n{where}; torch {torch.__version__}; bf16; target {args.target}, draft {args.draft}, attention "
          f"{attention}; {n} new tokens, prompt {args.prompt_len}, median of {args.repeats}\n")
    print(markdown(rows, list(rows[0])))
    if args.json_path:
        write_json(args.json_path, dict(device=where, torch=torch.__version__, command=" ".join(sys.argv),
                                        target=args.target, draft=args.draft, attention=attention,
                                        new_tokens=n, prompt_len=args.prompt_len, rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
