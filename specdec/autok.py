"""Dynamic draft length: pick k each step to maximise expected tokens per second.

With per-token acceptance alpha and k drafts, a step emits (1 - alpha^(k+1)) / (1 - alpha)
tokens on average (DESIGN.md section 4) and costs c_draft(k) + t_target(k + 1) seconds.
alpha is estimated online from the verified steps (accepted / drafts that were reached, the
maximum-likelihood estimate for a geometric run length), decayed so it follows the text; the
target's cost is a running least-squares line in the block size; the drafter measures its own
cost of k drafts (a draft model: one catch-up forward plus k - 1 one-token forwards).
"""

from __future__ import annotations

from collections.abc import Callable


class AutoK:
    """Online choice of the number of draft tokens, bounded to [k_min, k_max]."""

    def __init__(self, k_min: int = 1, k_max: int = 16, start: int = 4, decay: float = 0.95) -> None:
        self.k_min, self.k_max, self.k = k_min, k_max, start
        self.decay = decay
        self.accepted, self.reached = 1.0, 2.0  # weak prior: alpha = 0.5
        self._n = self._sx = self._sy = self._sxx = self._sxy = 0.0

    def alpha(self) -> float:
        return min(self.accepted / self.reached, 0.999)

    def observe(self, accepted: int, drafted: int, block: int, target_s: float) -> None:
        """One verified row-step: `accepted` of `drafted` drafts; the target pass took target_s
        seconds for a block of `block` tokens."""
        if drafted:
            self.accepted = self.decay * self.accepted + accepted
            self.reached = self.decay * self.reached + min(accepted + 1, drafted)
        d = self.decay
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

    def choose(self, draft_cost: Callable[[int], float]) -> int:
        """The k with the most expected tokens per second; draft_cost(k): seconds to draft k."""
        a = self.alpha()
        best_k, best_rate = self.k, -1.0
        for k in range(self.k_min, self.k_max + 1):
            tokens = (1 - a ** (k + 1)) / (1 - a)
            rate = tokens / (draft_cost(k) + self.target_cost(k + 1))
            if rate > best_rate:
                best_k, best_rate = k, rate
        self.k = best_k
        return best_k
