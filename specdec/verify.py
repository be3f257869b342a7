"""Verification of a drafted chain against one target forward: greedy and lossless rejection sampling.

Speculative sampling (Leviathan et al. 2023; Chen et al. 2023): accept draft x with probability
min(1, p(x) / q(x)); on the first rejection sample from norm(max(0, p - q)); when every draft
passes, sample a bonus token from p. The output distribution is exactly p. A deterministic draft
(argmax or n-gram) has q one-hot: accept when u < p(x), else zero p(x) and renormalise.
Greedy (temperature 0) accepts while the target's argmax equals the draft.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.sampling import check_finite, probs_from_logits


@dataclass
class Verdict:
    """Per row: how many drafts were accepted (B,) and the token that follows them (B,)."""

    accepted: torch.Tensor
    next_tokens: torch.Tensor


def _leading(flags: torch.Tensor) -> torch.Tensor:
    """Number of leading True values per row of flags (B, k) -> (B,)."""
    return flags.long().cumprod(-1).sum(-1)


def verify_greedy(logits: torch.Tensor, drafts: torch.Tensor, draft_lens: torch.Tensor) -> Verdict:
    """logits (B, k+1, V) of [pending, d_1..d_k]; drafts (B, k); draft_lens (B,) valid drafts."""
    check_finite(logits)
    best = logits.argmax(-1)  # (B, k+1)
    k = drafts.shape[1]
    valid = torch.arange(k, device=drafts.device)[None] < draft_lens[:, None]  # (B, k)
    accepted = _leading((best[:, :k] == drafts) & valid)  # (B,)
    nxt = best.gather(1, accepted[:, None]).squeeze(1)
    return Verdict(accepted, nxt)


def verify_sampling(logits: torch.Tensor, drafts: torch.Tensor, draft_lens: torch.Tensor,
                    q: torch.Tensor | None, temperature: float, top_k: int, top_p: float,
                    generator: torch.Generator | None) -> Verdict:
    """Lossless rejection sampling. q (B, k, V): the draft distributions, None for one-hot drafts."""
    check_finite(logits)
    B, k = drafts.shape
    p = probs_from_logits(logits, temperature, top_k, top_p)  # (B, k+1, V)
    p_draft = p[:, :k].gather(-1, drafts[..., None]).squeeze(-1)  # (B, k): p(x_i)
    q_draft = torch.ones_like(p_draft) if q is None else q.gather(-1, drafts[..., None]).squeeze(-1)
    u = torch.rand(B, k, generator=generator,
                   device=generator.device if generator is not None else p.device).to(p.device)
    valid = torch.arange(k, device=drafts.device)[None] < draft_lens[:, None]  # (B, k)
    accepted = _leading((u * q_draft < p_draft) & valid)  # (B,)
    rows = torch.arange(B, device=p.device)
    at = p[rows, accepted]  # (B, V): target distribution where the chain stopped
    rejected = accepted < draft_lens
    if bool(rejected.any()):
        idx = accepted.clamp(max=k - 1)
        if q is None:
            q_at = torch.zeros_like(at).scatter(-1, drafts[rows, idx][:, None], 1.0)  # one-hot
        else:
            q_at = q[rows, idx]
        residual = (at - q_at).clamp(min=0)
        mass = residual.sum(-1, keepdim=True)
        # p == q up to rounding leaves no residual mass; p itself is then the right law
        residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), at)
        at = torch.where(rejected[:, None], residual, at)
    nxt = torch.multinomial(at, 1, generator=generator).squeeze(1)
    return Verdict(accepted, nxt)
