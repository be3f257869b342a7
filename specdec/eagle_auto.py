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

from dataclasses import dataclass

import torch

from specdec.drafter import Accepted
from specdec.drafters.eagle import EagleDrafter, EagleTreeConfig
from specdec.eagle import Eagle3Head
from specdec.generate import generate
from specdec.tree_cost import step_seconds

SIZES = (2, 4, 8, 12, 16, 24, 32, 48, 64)  # tree nodes tried by auto (those a depth x top_k tree can hold)


@dataclass(frozen=True)
class EagleTreeCost:
    """One tree size on this machine: the measured step and the replayed acceptance."""

    total_tokens: int
    step_s: float  # seconds per decoding step with this tree (head drafting included)
    vs_plain: float  # step_s / plain step
    expected_tau: float  # 1 + mean accepted drafts per step, replayed from the largest tree's run
    expected_speedup: float  # expected_tau / vs_plain

    def to_dict(self) -> dict:
        return {"total_tokens": self.total_tokens, "step_ms": self.step_s * 1e3, "vs_plain": self.vs_plain,
                "expected_tau": self.expected_tau, "expected_speedup": self.expected_speedup}


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
                        repeats: int = 1) -> tuple[float, list[EagleTreeCost]]:
    """(plain step seconds, one EagleTreeCost per size): acceptance replayed from greedy runs of
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
        step = min(step_seconds(target, rows[0], tokens, drafter)[0] for _ in range(repeats))
        tau = replay_tau(recorder.paths, n)
        out.append(EagleTreeCost(total_tokens=n, step_s=step, vs_plain=step / plain, expected_tau=tau,
                                 expected_speedup=tau * plain / step))
    return plain, out


def best_size(costs: list[EagleTreeCost]) -> EagleTreeCost:
    """The size with the highest expected speed (ties: the smaller tree)."""
    if not costs:
        raise ValueError("no tree sizes were measured")
    return max(costs, key=lambda c: (c.expected_speedup, -c.total_tokens))


def auto_tree(target, head: Eagle3Head, rows: list[torch.Tensor], depth: int = 5, top_k: int = 8,
              sizes: tuple[int, ...] = SIZES, tokens: int = 32) -> tuple[EagleTreeConfig, dict]:
    """The tree `auto` picks on this machine for these prompts, and a JSON-ready record of the
    measurement (plain step, every size, the chosen one)."""
    plain, costs = measure_eagle_trees(target, head, rows, sizes, depth, top_k, tokens)
    best = best_size(costs)
    record = {"threads": torch.get_num_threads(), "plain_step_ms": plain * 1e3, "depth": depth, "top_k": top_k,
              "trees": [c.to_dict() for c in costs], "chosen_total_tokens": best.total_tokens}
    return EagleTreeConfig(depth, top_k, best.total_tokens), record


def describe(record: dict) -> str:
    """An `auto_tree` record as printable lines."""
    lines = [f"EAGLE-3 tree auto (depth {record['depth']}, top_k {record['top_k']}): plain step "
             f"{record['plain_step_ms']:.0f} ms"]
    lines += [f"  {t['total_tokens']:3d} nodes: step {t['step_ms']:.0f} ms = {t['vs_plain']:.2f}x plain, expected tau "
              f"{t['expected_tau']:.2f}, expected speed {t['expected_speedup']:.2f}x plain" for t in record["trees"]]
    lines.append(f"  chosen: {record['chosen_total_tokens']} nodes")
    return "\n".join(lines)
