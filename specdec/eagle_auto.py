"""`auto` for the EAGLE-3 draft tree: the number of tree nodes that gives the most tokens per second
on this machine.

For a fixed depth and top_k the dynamic tree's candidates do not depend on `total_tokens`, and the
kept nodes come in score order with parents before children (specdec.drafters.eagle), so the tree
of N nodes is the first N nodes of any larger one. One greedy run with the largest size therefore
replays every smaller size: a step whose accepted path holds the nodes i1 < i2 < ... would have
accepted, with N nodes, those below N. Expected tau(N) = 1 + their mean count per step. The cost
of a step of each size (head drafting and the target's tree forward) is timed on the same prompt
(`specdec.tree_cost.step_seconds`), and the chosen size maximises tau(N) / step(N), which is the
Medusa `--num-nodes auto` rule (specdec.tree_cost) with a replayed tau in place of the heads'
accuracy table. On a CPU a tree forward grows with its nodes, so small trees win; on a GPU a
forward of tens of tokens costs about one plain step, and the largest trees do.
"""

from __future__ import annotations

import torch

from specdec.drafter import Accepted
from specdec.drafters.eagle import EagleDrafter, EagleTreeConfig
from specdec.eagle import Eagle3Head
from specdec.generate import generate
from specdec.tree_cost import TreeCost, best_tree, cost_report, step_seconds

SIZES = (2, 4, 8, 12, 16, 24, 32, 48, 64)  # tree nodes tried by auto (those a depth x top_k tree can hold)


class _Recording(EagleDrafter):
    """An EagleDrafter that keeps every accepted path (node indices, in score order)."""

    def __init__(self, head: Eagle3Head, target, tree: EagleTreeConfig) -> None:
        super().__init__(head, target, tree)
        self.paths: list[list[int]] = []

    def commit(self, accepted: Accepted) -> None:
        self.paths.extend(list(p) for p in accepted.paths)
        super().commit(accepted)


def replay_tau(paths: list[list[int]], total_tokens: int) -> float:
    """1 + mean accepted drafts per step had the tree kept only its first `total_tokens` nodes."""
    if not paths:
        raise ValueError("no verification steps to replay: decode at least two tokens")
    return 1.0 + sum(sum(i < total_tokens for i in p) for p in paths) / len(paths)


def measure_eagle_trees(target, head: Eagle3Head, rows: list[torch.Tensor], sizes: tuple[int, ...] = SIZES,
                        depth: int = 5, top_k: int = 8, tokens: int = 32,
                        repeats: int = 1) -> tuple[float, list[TreeCost]]:
    """(plain step seconds, one specdec.tree_cost.TreeCost per size, `nodes` the tree's total_tokens
    and `heads_s` the head's drafting): acceptance replayed from greedy runs of
    `tokens` tokens on every prompt of `rows` (1-D ids) with the largest size, step costs timed on
    the first prompt (the fastest of `repeats`, after a warm-up). Sizes larger than a tree of this
    depth and top_k can hold are left out."""
    most = EagleTreeConfig(depth, top_k, 1).candidates
    fits = sorted({n for n in sizes if n <= most})
    if not fits or fits[0] < 1:
        raise ValueError(f"tree sizes must be >= 1 and some at most {most} (the candidates of a depth-{depth}, "
                         f"top_k-{top_k} tree), got {sizes}")
    if not rows or tokens < 2 or repeats < 1:
        raise ValueError(f"need prompts, tokens >= 2 and repeats >= 1, got {len(rows)} prompts, {tokens} and {repeats}")
    recorder = _Recording(head, target, EagleTreeConfig(depth, top_k, fits[-1]))
    for row in rows:
        generate(target, [row], draft=recorder, max_new_tokens=tokens)  # also the warm-up
    step_seconds(target, rows[0], 4)
    plain = min(step_seconds(target, rows[0], tokens)[0] for _ in range(repeats))
    out = []
    for n in fits:
        drafter = EagleDrafter(head, target, EagleTreeConfig(depth, top_k, n))
        step, in_head = min(step_seconds(target, rows[0], tokens, drafter) for _ in range(repeats))
        tau = replay_tau(recorder.paths, n)
        out.append(TreeCost(nodes=n, step_s=step, heads_s=in_head, vs_plain=step / plain, expected_tau=tau,
                            expected_speedup=tau * plain / step))
    return plain, out


def auto_tree(target, head: Eagle3Head, rows: list[torch.Tensor], depth: int = 5, top_k: int = 8,
              sizes: tuple[int, ...] = SIZES, tokens: int = 32) -> tuple[EagleTreeConfig, dict]:
    """The tree `auto` picks on this machine for these prompts (the highest expected speed, ties to
    the smaller tree), and a JSON-ready record of the measurement (`specdec.tree_cost.cost_report`
    plus depth and top_k; `trees[i].nodes` is a size's total_tokens)."""
    plain, costs = measure_eagle_trees(target, head, rows, sizes, depth, top_k, tokens)
    best = best_tree(costs)
    return EagleTreeConfig(depth, top_k, best.nodes), {"depth": depth, "top_k": top_k, **cost_report(plain, costs)}


def describe(record: dict) -> str:
    """An `auto_tree` record as printable lines."""
    lines = [f"EAGLE-3 tree auto (depth {record['depth']}, top_k {record['top_k']}): plain step "
             f"{record['plain_step_ms']:.0f} ms"]
    lines += [f"  {t['nodes']:3d} nodes: step {t['step_ms']:.0f} ms (head {t['heads_ms']:.0f}) = {t['vs_plain']:.2f}x "
              f"plain, expected tau {t['expected_tau']:.2f}, expected speed {t['expected_speedup']:.2f}x plain"
              for t in record["trees"]]
    lines.append(f"  chosen: {record['chosen_nodes']} nodes")
    return "\n".join(lines)
