"""Which Medusa tree pays on this machine: tree steps timed against plain steps, through generate().

Speed with Medusa is tau / (tree step / plain step). On a GPU a tree forward of tens of tokens
costs about one plain step, so the tree that maximises tau wins; on a CPU the forward grows with
the tree, and a small tree can beat a large one. `decode_cost` and `warm_up` time any drafter
(the EAGLE-3 tree's timing, `specdec.tuning.eagle_tree`, and the benchmarks use them);
`measure_trees` times each size's tree
(built from the heads' held-out accuracy table) on one prompt and `best_tree` picks the size
with the highest expected speed: (1 + expected accepted tokens per step) / step cost.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.drafters.medusa.heads import MedusaHeads
from specdec.drafters.medusa.tree import build_tree, expected_length
from specdec.generate import generate
from specdec.options import DEFAULT_NUM_DRAFT_TOKENS


@dataclass(frozen=True)
class TreeCost:
    """One tree size on this machine: measured step cost and expected gain."""

    nodes: int
    step_s: float  # seconds per decoding step with this tree
    heads_s: float  # of which in the heads (Medusa heads, or an EAGLE-3 head drafting its tree)
    vs_plain: float  # step_s / plain step
    expected_tau: float  # 1 + expected accepted draft tokens per step (held-out accuracy)
    expected_speedup: float  # expected_tau / vs_plain

    def to_dict(self) -> dict:
        return {"nodes": self.nodes, "step_ms": self.step_s * 1e3, "heads_ms": self.heads_s * 1e3,
                "vs_plain": self.vs_plain, "expected_tau": self.expected_tau,
                "expected_speedup": self.expected_speedup}


def decode_cost(model: torch.nn.Module, rows: list[torch.Tensor], tokens: int,
                draft=None, num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS) -> tuple[float, float, float]:
    """(seconds per decoding step after the prefill, seconds of it drafting, tokens per such step)
    of greedy decoding `tokens` tokens of every prompt in `rows` (1-D ids), one prompt at a time;
    draft: what `specdec.generate` takes (None = plain decoding), with `num_draft_tokens`."""
    steps = new = 0
    wall = drafting = 0.0
    for row in rows:
        s = generate(model, [row], draft=draft, max_new_tokens=tokens, num_draft_tokens=num_draft_tokens).stats
        steps += s.target_forwards - 1
        new += s.generated_tokens - 1  # the prefill's token is no step's
        wall += s.wall_s - s.ttft_s
        drafting += s.draft_s
    steps = max(steps, 1)
    return wall / steps, drafting / steps, new / steps


def warm_up(model: torch.nn.Module, rows: list[torch.Tensor], tokens: int, draft=None) -> None:
    """Decode untimed before timing `decode_cost(model, rows, tokens, draft)`. A compiled model builds a
    program the first time it meets a step shape (minutes on a CPU), and which shapes a tree size
    meets depends on its drafts (a chain runs without a block mask): it runs that whole decoding once
    (greedy, so the same drafts and shapes). An eager model decodes a few tokens of the first row."""
    if getattr(model, "compiled", False):
        decode_cost(model, rows, tokens, draft)
    else:
        decode_cost(model, rows[:1], 4, draft)


def step_seconds(model: torch.nn.Module, row: torch.Tensor, tokens: int,
                 heads: MedusaHeads | None = None) -> tuple[float, float]:
    """(seconds per decoding step after the prefill, seconds of it in the heads) over `tokens`
    greedy tokens from the prompt `row` (1-D ids); heads None = plain decoding."""
    return decode_cost(model, [row], tokens, heads)[:2]


def measure_trees(model: torch.nn.Module, heads: MedusaHeads, row: torch.Tensor, sizes: list[int],
                  accuracy: list[list[float]], tokens: int = 24,
                  repeats: int = 2) -> tuple[float, list[TreeCost]]:
    """(plain step seconds, one TreeCost per size): the fastest of `repeats` timings of `tokens`
    tokens each, each size after its `warm_up`. Leaves the heads on their last tree: set the one you want."""
    if not sizes or min(sizes) < 1:
        raise ValueError(f"tree sizes must be >= 1 node, got {sizes}")
    if tokens < 2 or repeats < 1:
        raise ValueError(f"need tokens >= 2 and repeats >= 1, got {tokens} and {repeats}")
    step_seconds(model, row, 4)  # warm-up
    plain = min(step_seconds(model, row, tokens)[0] for _ in range(repeats))
    out = []
    for n in sizes:
        tree = build_tree(accuracy, n)
        heads.set_tree(tree)
        warm_up(model, [row], tokens, heads)
        step, in_heads = min(step_seconds(model, row, tokens, heads) for _ in range(repeats))
        tau = 1 + expected_length(tree, accuracy)
        out.append(TreeCost(nodes=n, step_s=step, heads_s=in_heads, vs_plain=step / plain, expected_tau=tau,
                            expected_speedup=tau * plain / step))
    return plain, out


def best_tree(costs: list[TreeCost]) -> TreeCost:
    """The size with the highest expected speed (ties: the smaller tree)."""
    if not costs:
        raise ValueError("no tree sizes were measured")
    return max(costs, key=lambda c: (c.expected_speedup, -c.nodes))


def cost_report(plain: float, costs: list[TreeCost]) -> dict:
    """JSON-ready record of a `measure_trees` run (plain step seconds, its costs) and the chosen size."""
    return {"threads": torch.get_num_threads(), "plain_step_ms": plain * 1e3,
            "trees": [c.to_dict() for c in costs], "chosen_nodes": best_tree(costs).nodes}


def describe(plain: float, costs: list[TreeCost]) -> str:
    """The timings as printable lines: the plain step, then one line per tree size."""
    lines = [f"plain step {plain * 1e3:.0f} ms"]
    lines += [f"tree {c.nodes:3d} nodes: step {c.step_s * 1e3:.0f} ms = {c.vs_plain:.2f}x plain, expected tau "
              f"{c.expected_tau:.2f}, expected speed {c.expected_speedup:.2f}x plain" for c in costs]
    return "\n".join(lines)
