"""A repeated workload through `specdec serve`: the same requests sent twice, tau per pass.

    python benchmarks/suffix_cache_serve.py --out runs/suffix_serve                 # 1.5B 4-bit, suffix
    python benchmarks/suffix_cache_serve.py --draft "suffix|draft:qwen2.5-coder-0.5b-instruct@auto" --out runs/x

The server (one engine, --max-batch = --concurrency) keeps one drafter, so a `suffix` drafter's
cache of earlier responses is shared by every request: the second pass of the same 16 prompts
(HumanEval and held-out ShareGPT alternating, chat template, greedy) drafts from the first pass's
answers. Reported per pass: tau (generated tokens per target forward, from the engine's counters),
acceptance, tokens/s, and the answers of both passes must be equal (greedy decoding is lossless).
The cache's size after each pass (responses, tokens, trie nodes) and its memory bound are reported
too: bytes per trie node measured with tracemalloc on a trie of random tokens (the bound is
max_tokens x depth nodes). Writes suffix_serve.json and suffix_serve.md to --out.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import torch

import runtime
from runtime.atomic import atomic_write_text
from runtime.hardware import cpu_summary
from specdec.drafters.suffix import SuffixDrafter
from specdec.drafters.suffix_tree import SuffixTrie
from specdec.evaluation.evaluate import eos_ids, versions
from specdec.serving.engine import Engine
from specdec.serving.server import create_app, serve_while

sys.path.insert(0, str(Path(__file__).parent))
from serve_load import MODEL_NAME, Result, load_prompts, stream_request  # noqa: E402


def bytes_per_node(tokens: int = 20000, depth: int = 24, seed: int = 0) -> float:
    """Python heap bytes per trie node, measured on `tokens` random tokens (worst case: few shared paths)."""
    rng = random.Random(seed)
    seq = [rng.randrange(50000) for _ in range(tokens)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    trie = SuffixTrie(depth)
    trie.extend([], seq)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return used / trie.nodes


def send_all(port: int, prompts: list[list[int]], max_tokens: int, concurrency: int) -> list[Result]:
    """Every prompt as a streamed greedy request, at most `concurrency` in flight."""
    results = [Result(i, time.perf_counter()) for i in range(len(prompts))]
    gate = threading.Semaphore(concurrency)

    def run(i: int) -> None:
        with gate:
            stream_request(port, prompts[i], max_tokens, results[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="suffix", help="drafter spec (default: %(default)s)")
    ap.add_argument("--weights", default="auto", choices=["auto", "gguf", "dense"])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tok = runtime.load_tokenizer(args.model)
    target = runtime.load_model(args.model, dtype=torch.bfloat16, compile=args.compile, weights=args.weights)
    eos = eos_ids(args.model, tok)
    engine = Engine(target, args.draft, max_batch=args.concurrency, num_draft_tokens="auto", eos_token_id=eos)
    prompts = load_prompts(tok, args.requests, args.max_prompt_tokens)
    suffix = next((d for d in [engine.drafter, *getattr(engine.drafter, "drafters", [])]
                   if isinstance(d, SuffixDrafter)), None)
    def passes_of(port: int) -> list[dict]:
        """The two timed passes against the server on `port` (after the compile pass)."""
        passes = []
        if args.compile:  # compile the batch's programs on a throwaway pass of other prompts, then forget it
            send_all(port, load_prompts(tok, 2 * args.requests, args.max_prompt_tokens)[args.requests:],
                     16, args.concurrency)
            if suffix is not None and suffix.cache is not None:
                suffix.cache.clear()
        for n in range(2):
            before = engine.metrics
            start = time.perf_counter()
            results = send_all(port, prompts, args.max_tokens, args.concurrency)
            wall = time.perf_counter() - start
            after = engine.metrics
            errors = [r.error for r in results if r.error]
            if errors:
                raise SystemExit(f"pass {n + 1}: {len(errors)} requests failed: {errors[0]}")
            gen = after["generated_tokens"] - before["generated_tokens"]
            fwd = after["target_forwards"] - before["target_forwards"]
            drafted, accepted = after["drafted"] - before["drafted"], after["accepted"] - before["accepted"]
            cache = suffix.cache if suffix is not None else None
            passes.append({"pass": n + 1, "tau": gen / fwd, "acceptance": accepted / max(drafted, 1),
                           "tokens": gen, "tokens_per_s": gen / wall, "wall_s": wall,
                           "texts": [r.text for r in results],
                           "cache": None if cache is None else {"responses": cache.responses, "tokens": cache.tokens,
                                                                "nodes": cache.trie.nodes,
                                                                "max_tokens": cache.max_tokens, "depth": cache.depth},
                           "by_drafter": after["by_drafter"]})
            print(f"pass {n + 1}: tau {gen / fwd:.2f}, {gen / wall:.1f} tok/s", file=sys.stderr)
        return passes

    # the engine steps on the main thread, as in `specdec serve`
    passes = serve_while(create_app(engine, tok, MODEL_NAME), passes_of)
    same = passes[0]["texts"] == passes[1]["texts"]
    per_node = bytes_per_node()
    record = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"), "cpu": cpu_summary(),
              "versions": versions(), "model": args.model, "draft": args.draft, "requests": len(prompts),
              "concurrency": args.concurrency, "max_tokens": args.max_tokens, "compile": args.compile,
              "passes": passes, "tau_ratio": passes[1]["tau"] / passes[0]["tau"], "answers_equal": same,
              "bytes_per_node": per_node}
    atomic_write_text(out / "suffix_serve.json", json.dumps(record, indent=1))
    lines = [f"# Repeated workload: {args.draft} on {args.model}", "", f"`{record['command']}`", "",
             "| pass | tau | acceptance | tok/s | cache responses | cache tokens | trie nodes |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for p in passes:
        c = p["cache"] or {}
        lines.append(f"| {p['pass']} | {p['tau']:.2f} | {p['acceptance']:.2f} | {p['tokens_per_s']:.1f} | "
                     f"{c.get('responses', '-')} | {c.get('tokens', '-')} | {c.get('nodes', '-')} |")
    lines += ["", f"tau ratio (pass 2 / pass 1): {record['tau_ratio']:.2f}; answers equal: {same}; "
              f"{per_node:.0f} bytes per trie node"]
    atomic_write_text(out / "suffix_serve.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    if not same:
        raise SystemExit("the two passes' greedy answers differ")


if __name__ == "__main__":
    main()
