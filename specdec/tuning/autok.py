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
The target's cost is a running least-squares line in the block size; the drafter measures its
own cost of k drafts (a draft model: one catch-up forward plus k - 1 one-token forwards).
"""

from __future__ import annotations

from collections.abc import Callable

MAX_ACCEPTANCE = 0.999  # keeps a run of full acceptances from making every k look free


class AutoK:
    """Online choice of the number of draft tokens, bounded to [k_min, k_max]."""

    def __init__(self, k_min: int = 1, k_max: int = 16, start: int = 4, decay: float = 0.95,
                 prior_weight: float = 2.0) -> None:
        self.k_min, self.k_max, self.k = k_min, k_max, start
        self.decay, self.prior_weight = decay, prior_weight
        self.accepted, self.reached = 1.0, 2.0  # pooled over positions, weak prior: alpha = 0.5
        self.accepted_at = [0.0] * k_max  # [i]: decayed count of accepted drafts at position i + 1
        self.reached_at = [0.0] * k_max  # [i]: decayed count of steps that verified position i + 1
        self._n = self._sx = self._sy = self._sxx = self._sxy = 0.0

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

    def observe(self, accepted: int, drafted: int, block: int, target_s: float) -> None:
        """One verified row-step: `accepted` of `drafted` drafts; the target pass took target_s
        seconds for a block of `block` tokens."""
        d = self.decay
        if drafted:
            reached = min(accepted + 1, drafted)  # drafts the verification looked at
            self.accepted = d * self.accepted + accepted
            self.reached = d * self.reached + reached
            for i in range(self.k_max):
                self.accepted_at[i] = d * self.accepted_at[i] + (i < accepted)
                self.reached_at[i] = d * self.reached_at[i] + (i < reached)
        self._n = d * self._n + 1
        self._sx = d * self._sx + block
        self._sy = d * self._sy + target_s
        self._sxx = d * self._sxx + block * block
        self._sxy = d * self._sxy + block * target_s

    def target_cost(self, block: int) -> float:
        """Fitted seconds of one target pass over `block` tokens (flat until two sizes were seen)."""
        if self._n == 0:
            return 1.0
        mean_x, mean_y = self._sx / self._n, self._sy / self._n
        var = self._sxx / self._n - mean_x ** 2
        slope = (self._sxy / self._n - mean_x * mean_y) / var if var > 1e-6 else 0.0
        slope = max(slope, 0.0)
        return max(mean_y + slope * (block - mean_x), 1e-9)

    def expected_tokens(self) -> list[float]:
        """[k]: expected tokens one step with k drafts emits, bonus token included (k = 0..k_max)."""
        out, run = [1.0], 1.0
        for a in self.acceptance():
            run *= a
            out.append(out[-1] + run)
        return out

    def choose(self, draft_cost: Callable[[int], float]) -> int:
        """The k with the most expected tokens per second; draft_cost(k): seconds to draft k."""
        tokens = self.expected_tokens()
        best_k, best_rate = self.k, -1.0
        for k in range(self.k_min, self.k_max + 1):
            rate = tokens[k] / (draft_cost(k) + self.target_cost(k + 1))
            if rate > best_rate:
                best_k, best_rate = k, rate
        self.k = best_k
        return best_k
