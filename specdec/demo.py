"""`specdec demo` / `make demo`: fetch the Qwen2.5-Coder pair and compare decoders on HumanEval.

Runs `specdec eval` on the first few HumanEval prompts (raw completions, greedy, bf16, CPU) with
plain decoding, the 0.5B draft, n-gram prompt lookup and the hybrid of both (the models' GGUF
four-bit weights where the CPU kernels run fast: `runtime.load_model`'s default), against
transformers' generate() and its assisted generation, and against llama.cpp on the same GGUF
files when `make llamacpp` has built it, then prints the report table.
"""

from __future__ import annotations

import argparse

import runtime
from specdec.evaluation import llamacpp
from specdec.evaluation.evaluate import EvalConfig, check_out_dir, run_eval
from specdec.evaluation.report import render_markdown
from specdec.methods import DrafterSpec

DEMO_TARGET = "qwen2.5-coder-1.5b-instruct"
DEMO_DRAFT = "qwen2.5-coder-0.5b-instruct"


def run_demo(args: argparse.Namespace) -> int:
    """Check --out, fetch both models (cached after the first run), evaluate, print the Markdown report."""
    check_out_dir(args.out, overwrite=True)  # a path that cannot take the run fails before the downloads
    for name in (DEMO_TARGET, DEMO_DRAFT):
        print(f"model {name}: {runtime.fetch(name)}", flush=True)
    drafters = [DrafterSpec("draft", DEMO_DRAFT), DrafterSpec("ngram"), DrafterSpec("hybrid", DEMO_DRAFT)]
    methods = ["plain", *map(str, drafters), "hf", f"hf-assisted:{DEMO_DRAFT}"]
    if llamacpp.available():
        methods += ["llamacpp", f"llamacpp-spec:{DEMO_DRAFT}@4"]
    else:
        print("llama.cpp is not built here: `make llamacpp` adds it to the comparison")
    print(f"comparing {len(methods)} methods on {args.limit} HumanEval prompts: {', '.join(methods)}\n"
          "each is loaded and warmed up (untimed) before the timed generations; the first run on a machine also "
          "builds the CPU kernels (about a minute)", flush=True)
    methods = ",".join(methods)
    cfg = EvalConfig(out=args.out, methods=methods, target=DEMO_TARGET, dataset="humaneval",
                     limit=args.limit, raw=True, max_new_tokens=args.max_new_tokens, overwrite=True)
    report = run_eval(cfg)
    print(render_markdown(report))
    print(f"full report: {args.out}/report.md (plots: acceptance.png, speedup.png)")
    return 0
