"""Dynamic draft length: pick k each step to maximise expected tokens per second.

A step with k drafts emits 1 + sum_{j=1..k} prod_{i<=j} a_i tokens on average, where a_i is the
probability that draft i is accepted given that drafts 1..i-1 were; it costs
c_draft(k) + t_target(k + 1) seconds. With one acceptance rate alpha for every position this is
(1 - alpha^(k+1)) / (1 - alpha) (Leviathan et al. 2023), but acceptance tends to rise with the
position (once the first drafts match, the text is an easy stretch), and a single rate under-rates
long drafts. So a_i is estimated per
position from the verified steps (accepted / reached at that position), decayed so it follows
the text, and shrunk towards the estimate of the position before it (position 1: towards the
pooled rate), so a position seldom or never reached takes the rate of the one before it.
The target's cost is measured per block size as decoding goes (`specdec.tuning.costs.BlockCosts`,
shared by the calls on one target: `target_costs`), a size not timed yet taking the cost of a
timed one that the target pads to the same length (a compiled step pads blocks to 2, 4, 8, ...
tokens, and on 4-bit weights a padded 8-token block costs about twice a 4-token one, a step no
straight line through the sizes seen follows). The sizes past the largest timed one cost what it
did until timed, so the choice tries them; before anything is timed, k_min drafts are tried
first. The drafter measures its own cost of k drafts (a draft model: one catch-up forward plus
k - 1 one-token forwards).
"""

from __future__ import annotations

from collections.abc import Callable

from specdec.tuning.costs import BlockCosts

MAX_ACCEPTANCE = 0.999  # keeps a run of full acceptances from making every k look free


class AutoK:
    """Online choice of the number of draft tokens, bounded to [k_min, k_max]."""

    def __init__(self, k_min: int = 1, k_max: int = 16, decay: float = 0.95, prior_weight: float = 2.0,
                 costs: BlockCosts | None = None) -> None:
        """costs: the target's verification seconds by block size, shared with other calls
        (`specdec.tuning.costs.target_costs`; default: this one's own)."""
        self.k_min, self.k_max, self.k = k_min, k_max, k_min
        self.decay, self.prior_weight = decay, prior_weight
        self.accepted, self.reached = 1.0, 2.0  # pooled over positions, weak prior: alpha = 0.5
        self.accepted_at = [0.0] * k_max  # [i]: decayed count of accepted drafts at position i + 1
        self.reached_at = [0.0] * k_max  # [i]: decayed count of steps that verified position i + 1
        self.costs = BlockCosts() if costs is None else costs

    def alpha(self) -> float:
        """Acceptance rate pooled over positions (accepted / reached drafts)."""
        return min(self.accepted / self.reached, MAX_ACCEPTANCE)

    def acceptance(self) -> list[float]:
        """[i]: estimated probability that draft i + 1 is accepted given drafts 1..i were."""
        out, prior = [], self.alpha()
        for acc, reach in zip(self.accepted_at, self.reached_at):
            prior = min((acc + self.prior_weight * prior) / (reach + self.prior_weight), MAX_ACCEPTANCE)
            out.append(prior)
        return out

    def observe(self, accepted: int, drafted: int) -> None:
        """One verified row-step: `accepted` of `drafted` drafts."""
        if not drafted:
            return
        d = self.decay
        reached = min(accepted + 1, drafted)  # drafts the verification looked at
        self.accepted = d * self.accepted + accepted
        self.reached = d * self.reached + reached
        for i in range(self.k_max):
            self.accepted_at[i] = d * self.accepted_at[i] + (i < accepted)
            self.reached_at[i] = d * self.reached_at[i] + (i < reached)

    def time_block(self, block: int, seconds: float, step: int = 0) -> None:
        """One verification (the whole batch's) of `block` tokens per row took `seconds`; step: its
        number (`BlockCosts.observe`)."""
        self.costs.observe(block, seconds, step)

    def target_cost(self, block: int) -> float | None:
        """Measured seconds of one verification of `block` tokens (`BlockCosts.cost`); None before any
        verification was timed."""
        return self.costs.cost(block) if self.costs.sizes() else None

    def expected_tokens(self) -> list[float]:
        """[k]: expected tokens one step with k drafts emits, bonus token included (k = 0..k_max)."""
        out, run = [1.0], 1.0
        for a in self.acceptance():
            run *= a
            out.append(out[-1] + run)
        return out

    def choose(self, draft_cost: Callable[[int], float]) -> int:
        """The k with the most expected tokens per second; draft_cost(k): seconds to draft k. Before
        any verification was timed: k_min (the smallest block is timed first, so that the sizes past
        it, taken as no dearer until timed, are tried next)."""
        if not self.costs.sizes():
            self.k = self.k_min
            return self.k
        tokens = self.expected_tokens()
        best_k, best_rate = self.k, -1.0
        for k in range(self.k_min, self.k_max + 1):
            rate = tokens[k] / (draft_cost(k) + self.target_cost(k + 1))
            if rate > best_rate:
                best_k, best_rate = k, rate
        self.k = best_k
        return best_k
