"""What one speculative round costs against one plain decoding step, on the machine at hand.

    python benchmarks/speculative_rounds.py --json rounds.json                 # on a GPU
    TRITON_INTERPRET=1 python benchmarks/speculative_rounds.py --smoke          # the script itself, on a CPU

Speed with any drafter is tau / (round / plain step): a round drafts, then the target verifies the
draft in one forward. What a round costs depends little on what the drafter guesses (acceptance
adds only catch-up work), so this times rounds on randomly initialised models with the real
Qwen2.5-Coder shapes (the 1.5B target, the 0.5B draft, an EAGLE-3 head with a 32k draft
vocabulary), where a machine cannot hold the real checkpoints (the lent GPU machines reach no
model hub). Their drafts are almost never accepted, so every step is one round. Methods, one
random prompt, batch 1, greedy; after a warm-up of each, `--repeats` rounds of all methods in
turn (so drift of the machine hits them alike), median per method:

  plain               specdec.generate without a drafter (one plain step)
  eagle DxK/N         an EAGLE-3 head, dynamic tree of depth D, top-k K, N nodes verified
  draft kN            the random 0.5B draft, N tokens per round
  transformers        transformers' generate() on the same target weights (the baseline of the
                      4x targets): (time of N tokens - time of 1) / (N - 1)

A round is timed after the prefill (`specdec.tuning.tree_cost.decode_cost`: generate()'s own clock,
wall - time to first token, over the steps). For each method: ms a round, of it drafting, round /
plain step (the tau at which the method breaks even with plain decoding) and the tau it needs
for 4x transformers' generate(): 4 x round / transformers' ms per token. Acceptance itself (tau)
is the draft's quality and is measured with `specdec eval` on real checkpoints; tau / (round /
plain step) is the speed the same draft would reach here.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import gpu_or_smoke, markdown, random_qwen, sync, write_json  # noqa: E402  (beside this one)

from runtime.attention import default_backend  # noqa: E402
from specdec.drafters.eagle.drafter import EagleDrafter, EagleTreeConfig  # noqa: E402
from specdec.drafters.eagle.head import Eagle3Config, Eagle3Head  # noqa: E402
from specdec.tuning.tree_cost import decode_cost  # noqa: E402


def trees(text: str) -> list[EagleTreeConfig]:
    """"5x8/48,8x10/96" -> EagleTreeConfig(depth, top_k, total_tokens) per item."""
    out = []
    for item in text.split(","):
        shape, _, total = item.partition("/")
        depth, _, top_k = shape.partition("x")
        out.append(EagleTreeConfig(depth=int(depth), top_k=int(top_k), total_tokens=int(total)))
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="1.5b", help="target config: 1.5b, 0.5b or tiny (default: %(default)s)")
    p.add_argument("--draft", default="0.5b", help="draft config for the draft rounds (default: %(default)s)")
    p.add_argument("--trees", type=trees, default=trees("5x8/48,6x10/64,8x10/96"),
                   help="EAGLE trees as DEPTHxTOPK/NODES, comma-separated (default: 5x8/48,6x10/64,8x10/96)")
    p.add_argument("--draft-tokens", default="4,6", help="draft-model tokens per round (default: %(default)s)")
    p.add_argument("--draft-vocab", type=int, default=32000, help="EAGLE draft vocabulary (default: %(default)s)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens (default: %(default)s)")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens per timed run (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per method, median (default: %(default)s)")
    p.add_argument("--attention", default=None, help="sdpa or triton (default: the device's default backend)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_path", default=None, help="also write every row to this JSON file")
    p.add_argument("--smoke", action="store_true",
                   help="tiny configs on the CPU: checks the script, times nothing real")
    return p.parse_args(argv)


def figures(method: str, step_s: list[float], draft_s: list[float], plain_s: float, hf_s: float) -> dict:
    """One table row from a method's per-run seconds per round (and of it drafting), the median
    plain step and transformers' median seconds per token."""
    step = statistics.median(step_s)
    return dict(method=method, round_ms=1e3 * step, draft_ms=1e3 * statistics.median(draft_s),
                min_ms=1e3 * min(step_s), max_ms=1e3 * max(step_s), vs_plain_step=step / plain_s,
                tau_for_4x_transformers=4 * step / hf_s)


def hf_token_seconds(hf, ids: torch.Tensor, n: int) -> float:
    """transformers generate()'s seconds per token after the first: (t(n tokens) - t(1)) / (n - 1)."""
    kwargs = dict(do_sample=False, pad_token_id=0)
    times = []
    for m in (1, n):
        sync(ids.device)
        start = time.perf_counter()
        hf.generate(ids, max_new_tokens=m, min_new_tokens=m, **kwargs)
        sync(ids.device)
        times.append(time.perf_counter() - start)
    return (times[1] - times[0]) / (n - 1)


def main(argv: list[str] | None = None) -> int:
    """Build the random models, time every method in turn, print the table (and write --json)."""
    args = parse_args(argv)
    device = gpu_or_smoke(args, "speculative_rounds.py times GPU rounds",
                          "CPU rounds of real checkpoints: benchmarks/medusa_step_cost.py")
    dtype = torch.bfloat16
    torch.manual_seed(args.seed)  # transformers initialises weights from the global generator
    hf, target = random_qwen(args.target, dtype, device, args.attention)
    draft = random_qwen(args.draft, dtype, device, args.attention)[1]
    cfg = hf.config
    aux = None if cfg.num_hidden_layers >= 4 else (0, 1, 1)  # the tiny smoke config has 2 layers
    head_cfg = Eagle3Config.from_target(target, draft_vocab_size=min(args.draft_vocab, cfg.vocab_size),
                                        aux_layers=aux, fc_norm=True, norm_output=True)
    head = Eagle3Head(head_cfg).to(device=device, dtype=dtype).eval()
    row = torch.randint(0, cfg.vocab_size, (args.prompt_len,), generator=torch.Generator().manual_seed(args.seed))
    ids = row[None].to(device)  # (1, T) for transformers
    n = args.new_tokens

    methods: dict[str, tuple[object, int]] = {"plain": (None, 5)}  # name -> (draft, tokens a round)
    for tree in args.trees:
        methods[f"eagle {tree.depth}x{tree.top_k}/{tree.total_tokens}"] = (EagleDrafter(head, target, tree), 5)
    for k in (int(x) for x in args.draft_tokens.split(",") if x):
        methods[f"draft k{k}"] = (draft, k)
    for drafter, k in methods.values():  # warm-up: kernel compilation, allocator
        decode_cost(target, [row], 8, drafter, k)
    hf_token_seconds(hf, ids, 8)
    steps = {name: [] for name in methods}
    drafting = {name: [] for name in methods}
    hf_s = []
    for _ in range(args.repeats):
        for name, (drafter, k) in methods.items():
            step_s, draft_s, _ = decode_cost(target, [row], n, drafter, k)
            steps[name].append(step_s)
            drafting[name].append(draft_s)
        hf_s.append(hf_token_seconds(hf, ids, n))
    plain_s, hf_med = statistics.median(steps["plain"]), statistics.median(hf_s)
    rows = [figures(name, steps[name], drafting[name], plain_s, hf_med) for name in methods]
    rows.append(figures("transformers generate()", hf_s, [0.0], plain_s, hf_med))
    where = "CPU (smoke run)" if args.smoke else torch.cuda.get_device_name()
    attention = target.attention or default_backend(device)
    print(f"\n{where}; torch {torch.__version__}; bf16; target {args.target}, draft {args.draft}, attention "
          f"{attention}; {n} new tokens, prompt {args.prompt_len}, median of {args.repeats} (min and max beside)\n")
    print(markdown(rows, list(rows[0])))
    if args.json_path:
        write_json(args.json_path, dict(device=where, torch=torch.__version__, command=" ".join(sys.argv),
                                        target=args.target, draft=args.draft, attention=attention,
                                        new_tokens=n, prompt_len=args.prompt_len, repeats=args.repeats, rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
