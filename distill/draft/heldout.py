"""Held-out agreement of a draft with its target, teacher-forced on the target's greedy answers.

Greedy speculative decoding accepts a drafted token exactly when the draft's argmax equals the
target's next greedy token, and the accepted prefix is always the target's own greedy path. So
the draft's top-1 agreement with the target's greedy answers to held-out prompts, read at every
answer position, is the per-token acceptance probability of greedy speculative decoding on
those prompts. It comes from one draft forward over cached sequences (the target answers once),
with no drafting and none of the noise of which positions a few decoded prompts happen to reach:
`distill.distill_draft` measures it at every held-out evaluation, and the comparison of divergences and
data sources in recipes/distill_qwen05_draft.py ranks runs by it.

`expected_tau(a, k)`: tokens per target forward when each of k drafted tokens is accepted with
probability a independently of the others, (1 - a^(k+1)) / (1 - a). Real acceptance is
correlated along an answer, so this is a yardstick for comparing drafts, not a prediction.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from distill.draft.onpolicy import make_batch, sample_answers
from runtime.atomic import atomic_write_text


@dataclass(frozen=True)
class HeldoutSet:
    """Held-out prompts and the target's greedy answers to them (token id lists, one per prompt),
    cut at `max_new_tokens` (None: not recorded)."""

    prompts: list[list[int]]
    answers: list[list[int]]
    max_new_tokens: int | None = None

    def __post_init__(self) -> None:
        if len(self.prompts) != len(self.answers) or not self.prompts:
            raise ValueError(f"a held-out set needs one answer per prompt and at least one prompt, got "
                             f"{len(self.prompts)} prompts and {len(self.answers)} answers")
        if not any(self.answers):
            raise ValueError("every held-out answer is empty: the target stopped at once on each prompt")

    @property
    def positions(self) -> int:
        """Answer tokens scored (one per answer token)."""
        return sum(len(a) for a in self.answers)

    def save(self, path: str | Path) -> None:
        atomic_write_text(Path(path), json.dumps({"prompts": self.prompts, "answers": self.answers,
                                                  "max_new_tokens": self.max_new_tokens}))

    @classmethod
    def load(cls, path: str | Path) -> HeldoutSet:
        data = json.loads(Path(path).read_text())
        return cls([list(map(int, p)) for p in data["prompts"]], [list(map(int, a)) for a in data["answers"]],
                   data.get("max_new_tokens"))


def target_answers(target, prompts: list[list[int]], max_new_tokens: int,
                   eos_token_id: int | list[int] | None = None) -> HeldoutSet:
    """The target's greedy answers (at most `max_new_tokens`, ending at eos) to `prompts`."""
    answers = sample_answers(target, prompts, max_new_tokens, 0.0, torch.Generator(), eos_token_id)
    return HeldoutSet([list(p) for p in prompts], answers, max_new_tokens)


def expected_tau(agreement: float, k: int) -> float:
    """Tokens per target forward with k drafts each accepted with probability `agreement`."""
    if k < 1:
        raise ValueError(f"k (drafted tokens per step) must be >= 1, got {k}")
    if agreement >= 1.0:
        return float(k + 1)
    return (1.0 - agreement ** (k + 1)) / (1.0 - agreement)


@torch.no_grad()
def agreement(draft, held: HeldoutSet, k: int = 5, rows_per_forward: int = 4, bf16: bool = False) -> dict:
    """The draft's top-1 agreement with the target's greedy answers (teacher-forced), its mean
    cross-entropy on them (nats per token), and `expected_tau` at k drafts. bf16: autocast the
    draft's forward to bf16 (where the hardware multiplies bf16 natively)."""
    hits, nll, count = 0, 0.0, 0
    device = draft.device
    for start in range(0, len(held.prompts), rows_per_forward):
        batch = make_batch(held.prompts[start:start + rows_per_forward],
                           held.answers[start:start + rows_per_forward]).to(device)
        if not batch.answer_tokens:
            continue
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = draft(batch.tokens, batch.positions, None, logits_idx=batch.idx).logits  # (B, N, V)
        # (B, N): the answer token each position predicts (clamped where a row without an answer pads idx)
        nxt = batch.tokens.gather(1, (batch.idx + 1).clamp(max=batch.tokens.shape[1] - 1))
        logits = logits.float()[batch.valid]  # (M, V)
        nxt = nxt[batch.valid]  # (M,)
        hits += int((logits.argmax(-1) == nxt).sum())
        nll += float(F.cross_entropy(logits, nxt, reduction="sum"))
        count += int(nxt.numel())
    rate = hits / count
    return {"agreement": rate, "ce": nll / count, "expected_tau": expected_tau(rate, k), "positions": count}
