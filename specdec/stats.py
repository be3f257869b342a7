"""AcceptanceStats: what a generate() call or an evaluation run measured.

Convention (used in every report): tau = `mean_accepted_tokens` = tokens emitted per target
forward pass, the bonus / correction token included. Plain decoding has tau = 1; with k drafts
per step tau lies in [1, k + 1]. The prefill forward counts as a target forward (it emits the
first token). Counts are summed over rows: a forward that serves B active rows counts B times.
`acceptance_rate` = accepted / drafted draft tokens, where a step drafts as many tokens as its
longest valid path holds (a chain: its length; a tree: its depth); when an eos among the
accepted drafts ends a row, that step counts drafted, reached and accepted positions up to the
eos only (a perfect draft keeps an acceptance rate of 1).
`per_position_acceptance[i]` = P(draft i accepted | drafts before i accepted), i from 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def step_counts(drafted: int, reached: int, accepted: int, emitted: int) -> tuple[int, int, int]:
    """A step's (drafted, reached, accepted) as counted: when an eos among the accepted drafts
    ended the row (emitted <= accepted), all three stop at the eos."""
    return (emitted,) * 3 if emitted <= accepted else (drafted, reached, accepted)


@dataclass
class AcceptanceStats:
    """Counters and timings of speculative (or plain) decoding; `merge` aggregates runs."""

    target_forwards: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    generated_tokens: int = 0
    position_drafted: list[int] = field(default_factory=list)
    position_accepted: list[int] = field(default_factory=list)
    wall_s: float = 0.0
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    num_calls: int = 0

    @property
    def mean_accepted_tokens(self) -> float:
        """tau: tokens emitted per target forward, bonus token included."""
        return self.generated_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.position_accepted, self.position_drafted)]

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def record_step(self, drafted: int, reached: int, accepted: int, emitted: int) -> None:
        """One row's verification step: `drafted` drafts on its longest valid path, `reached` of
        them looked at, `accepted` accepted, `emitted` tokens emitted (the target's one included)."""
        drafted, reached, accepted = step_counts(drafted, reached, accepted, emitted)
        self.target_forwards += 1
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        self.generated_tokens += emitted
        self.record_positions([1] * reached + [0] * (drafted - reached), [1] * accepted + [0] * (drafted - accepted))

    def record_positions(self, drafted: list[int], accepted: list[int]) -> None:
        """Add per-position counts: drafted[i] drafts reached position i, accepted[i] passed."""
        grow = len(drafted) - len(self.position_drafted)
        if grow > 0:
            self.position_drafted += [0] * grow
            self.position_accepted += [0] * grow
        for i, (d, a) in enumerate(zip(drafted, accepted)):
            self.position_drafted[i] += d
            self.position_accepted[i] += a

    def merge(self, other: "AcceptanceStats") -> "AcceptanceStats":
        """Aggregate another run into this one (timings: sums; ttft / tpot: means per call)."""
        calls = self.num_calls + other.num_calls
        if calls:
            self.ttft_s = (self.ttft_s * self.num_calls + other.ttft_s * other.num_calls) / calls
            self.tpot_s = (self.tpot_s * self.num_calls + other.tpot_s * other.num_calls) / calls
        self.num_calls = calls
        for name in ("target_forwards", "drafted_tokens", "accepted_tokens", "generated_tokens",
                     "wall_s", "draft_s", "verify_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.record_positions(other.position_drafted, other.position_accepted)
        return self

    def to_dict(self) -> dict:
        """JSON-ready; includes the derived fields and the tau convention."""
        return {
            "target_forwards": self.target_forwards,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "generated_tokens": self.generated_tokens,
            "mean_accepted_tokens": self.mean_accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "per_position_acceptance": self.per_position_acceptance,
            "position_drafted": list(self.position_drafted),
            "position_accepted": list(self.position_accepted),
            "wall_s": self.wall_s,
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
            "tokens_per_second": self.tokens_per_second,
            "draft_s": self.draft_s,
            "verify_s": self.verify_s,
            "num_calls": self.num_calls,
            "tau_convention": "tokens emitted per target forward, bonus token included",
        }

    @classmethod
    def from_dict(cls, d: dict) -> "AcceptanceStats":
        keys = ("target_forwards", "drafted_tokens", "accepted_tokens", "generated_tokens",
                "position_drafted", "position_accepted", "wall_s", "ttft_s", "tpot_s", "draft_s",
                "verify_s", "num_calls")
        # lists are copied: merging into the result must not change `d` (a report merges the same
        # generation records once overall and once per category)
        return cls(**{k: list(d[k]) if isinstance(d[k], list) else d[k] for k in keys if k in d})
