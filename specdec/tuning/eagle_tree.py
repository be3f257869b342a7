"""`auto` for the EAGLE-3 draft tree: the number of tree nodes that gives the most tokens per second
on this machine.

Greedy speculative decoding is lossless, so every tree size decodes the same text from the same
prompts: each size runs on them, and its tau (tokens per decoding step after the prefill) and step
cost (head drafting plus the target's tree forward) are measured on that one text, a paired
comparison. The chosen size maximises tau / (step / plain step), the Medusa `--num-nodes auto`
rule (`specdec.tuning.tree_cost`, whose TreeCost records each size). (Replaying every size from one run
with the largest tree would be cheaper, since a tree of N nodes is the first N nodes of a larger
one, but it is biased: the large tree's steps under-sample the easy stretches it crosses fast.)
On a CPU a tree forward grows with its nodes, so small trees win; on a GPU a forward of tens of
tokens costs about one plain step, and the larger trees do.

`TreeTuner` is what a `specdec.loader.DrafterLoader` asks for the tree of an `eagle:DIR@auto` spec:
it times the sizes on the first of its calibration prompts that fits and keeps the record.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable

import torch

from runtime.errors import ContextLengthError
from specdec.drafters.eagle.drafter import AUTO_TREE_SIZES as SIZES
from specdec.drafters.eagle.drafter import EagleDrafter, EagleTreeConfig
from specdec.drafters.eagle.head import Eagle3Head
from specdec.tuning.tree_cost import TreeCost, best_tree, cost_report, decode_cost, step_seconds, warm_up


def measure_eagle_trees(target, head: Eagle3Head, rows: list[torch.Tensor], sizes: tuple[int, ...] = SIZES,
                        depth: int = EagleTreeConfig.depth, top_k: int = EagleTreeConfig.top_k, tokens: int = 32,
                        repeats: int = 1) -> tuple[float, list[TreeCost]]:
    """(plain step seconds on rows[0], one specdec.tuning.tree_cost.TreeCost per size: `nodes` the tree's
    total_tokens, `heads_s` the head's drafting, `expected_tau` the measured tokens per step), each
    size decoding `tokens` tokens of every prompt of `rows` (1-D ids), the fastest of `repeats`,
    each after its `specdec.tuning.tree_cost.warm_up` (a compiled target builds a program per step
    shape the first time it meets one). Sizes larger than a tree of this depth and top_k can hold
    are left out."""
    most = EagleTreeConfig(depth, top_k, 1).candidates
    fits = sorted({n for n in sizes if n <= most})
    if not fits or fits[0] < 1:
        raise ValueError(f"tree sizes must be >= 1 and some at most {most} (the candidates of a depth-{depth}, "
                         f"top_k-{top_k} tree), got {sizes}")
    if not rows or tokens < 2 or repeats < 1:
        raise ValueError(f"need prompts, tokens >= 2 and repeats >= 1, got {len(rows)} prompts, {tokens} and {repeats}")
    step_seconds(target, rows[0], 4)  # warm-up
    plain = min(step_seconds(target, rows[0], tokens)[0] for _ in range(repeats))
    out = []
    for n in fits:
        drafter = EagleDrafter(head, target, EagleTreeConfig(depth, top_k, n))
        warm_up(target, rows, tokens, drafter)
        step, in_head, tau = min(decode_cost(target, rows, tokens, drafter) for _ in range(repeats))
        out.append(TreeCost(nodes=n, step_s=step, heads_s=in_head, vs_plain=step / plain, expected_tau=tau,
                            expected_speedup=tau * plain / step))
    return plain, out


def auto_tree(target, head: Eagle3Head, rows: list[torch.Tensor], depth: int = EagleTreeConfig.depth,
              top_k: int = EagleTreeConfig.top_k,
              sizes: tuple[int, ...] = SIZES, tokens: int = 32) -> tuple[EagleTreeConfig, dict]:
    """The tree `auto` picks on this machine for these prompts (the highest expected speed, ties to
    the smaller tree), and a JSON-ready record of the measurement (`specdec.tuning.tree_cost.cost_report`
    plus depth and top_k; `trees[i].nodes` is a size's total_tokens)."""
    plain, costs = measure_eagle_trees(target, head, rows, sizes, depth, top_k, tokens)
    best = best_tree(costs)
    return EagleTreeConfig(depth, top_k, best.nodes), {"depth": depth, "top_k": top_k, **cost_report(plain, costs)}


def describe(record: dict) -> str:
    """An `auto_tree` record as printable lines."""
    lines = [f"EAGLE-3 tree auto (depth {record['depth']}, top_k {record['top_k']}): plain step "
             f"{record['plain_step_ms']:.0f} ms"]
    lines += [f"  {t['nodes']:3d} nodes: step {t['step_ms']:.0f} ms (head {t['heads_ms']:.0f}) = {t['vs_plain']:.2f}x "
              f"plain, tau {t['expected_tau']:.2f}, expected speed {t['expected_speedup']:.2f}x plain"
              for t in record["trees"]]
    lines.append(f"  chosen: {record['chosen_nodes']} nodes")
    return "\n".join(lines)


class TreeTuner:
    """Picks the tree of `eagle:DIR@auto` specs by timing sizes (`auto_tree`) on the first of
    `calibration` ((label, 1-D prompt ids) pairs, or a callable giving them when first needed) that
    fits the context; `records` maps each spec's text to its measurement with the prompt's label
    (`specdec eval` writes them to tree_auto.json). `log` (a callable taking a line) is told first."""

    def __init__(self, calibration: Iterable | Callable[[], Iterable] = (),
                 log: Callable[[str], None] | None = None) -> None:
        self.calibration, self.log = calibration, log
        self.records: dict[str, dict] = {}

    def prompts(self) -> Iterable:
        """The (label, ids) pairs, in order."""
        return self.calibration() if callable(self.calibration) else iter(self.calibration)

    def tree(self, spec, target, head: Eagle3Head) -> EagleTreeConfig:
        """The tree for `spec` (an eagle DrafterSpec of size "auto"): sizes timed on the first prompt
        that fits; ValueError when no prompt was given, ContextLengthError when none fits."""
        if self.log is not None:
            self.log("timing EAGLE-3 tree sizes on this machine (@auto)")
        tried = False
        for label, ids in self.prompts():
            tried = True
            try:
                tree, record = auto_tree(target, head, [ids], **spec.tree_fields)
            except ContextLengthError:
                continue
            print(describe(record), file=sys.stderr, flush=True)
            self.records[str(spec)] = {"prompt": label, **record}
            return tree
        if not tried:
            raise ValueError(f"{spec}: @auto times tree sizes on prompts, and none were given; write @N (the "
                             "tree's nodes), or time them with specdec eval / specdec serve")
        raise ContextLengthError(f"{spec}: no prompt fits the context to measure tree sizes on")
