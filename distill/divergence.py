"""Token-level divergences between a draft (student) and its target (teacher), for DistillSpec.

Each compares, at every scored position, the teacher's next-token distribution p and the
student's q over the full vocabulary, both taken at a distillation temperature tau
(softmax(logits / tau)), and returns one value per position:

    fkl  forward KL   KL(p || q) = sum_v p_v (log p_v - log q_v)        (mass-covering)
    rkl  reverse KL   KL(q || p) = sum_v q_v (log q_v - log p_v)        (mode-seeking)
    jsd  generalized JSD(beta), as GKD (Agarwal et al. 2024, TRL's GKDTrainer) defines it:
         m = beta p + (1 - beta) q, JSD = beta KL(p || m) + (1 - beta) KL(q || m);
         beta = 0 is taken as fkl and beta = 1 as rkl (GKD's convention at the ends)
    tvd  total variation  TV(p, q) = 1/2 sum_v |p_v - q_v|; greedy-free speculative sampling
         accepts a token with probability sum_v min(p_v, q_v) = 1 - TV(p, q), so TVD is the
         divergence DistillSpec matches to acceptance.

`masked_divergence` averages one of them over the positions a boolean mask keeps (the answer
tokens), computing in float32 whatever the logits' dtype.
"""

from __future__ import annotations

import torch

DIVERGENCES = ("fkl", "rkl", "jsd", "tvd")


def _kl(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """KL(a || b) per row from log-probabilities (N, V) -> (N,); 0 log 0 counts as 0."""
    a = log_a.exp()
    return torch.where(a > 0, a * (log_a - log_b), torch.zeros_like(a)).sum(-1)


def forward_kl(student_logp: torch.Tensor, teacher_logp: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row, from log q and log p (N, V) -> (N,)."""
    return _kl(teacher_logp, student_logp)


def reverse_kl(student_logp: torch.Tensor, teacher_logp: torch.Tensor) -> torch.Tensor:
    """KL(q || p) per row, from log q and log p (N, V) -> (N,)."""
    return _kl(student_logp, teacher_logp)


def generalized_jsd(student_logp: torch.Tensor, teacher_logp: torch.Tensor, beta: float) -> torch.Tensor:
    """GKD's JSD(beta) per row: beta KL(p || m) + (1 - beta) KL(q || m), m = beta p + (1 - beta) q."""
    if not 0 <= beta <= 1:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    if beta == 0:
        return forward_kl(student_logp, teacher_logp)
    if beta == 1:
        return reverse_kl(student_logp, teacher_logp)
    log_m = torch.logsumexp(torch.stack([teacher_logp + torch.log(torch.tensor(beta)),
                                         student_logp + torch.log(torch.tensor(1 - beta))]), dim=0)  # (N, V)
    return beta * _kl(teacher_logp, log_m) + (1 - beta) * _kl(student_logp, log_m)


def total_variation(student_logp: torch.Tensor, teacher_logp: torch.Tensor) -> torch.Tensor:
    """TV(p, q) = 1/2 sum_v |p_v - q_v| per row (N, V) -> (N,)."""
    return 0.5 * (teacher_logp.exp() - student_logp.exp()).abs().sum(-1)


def token_divergence(student_logits: torch.Tensor, teacher_logits: torch.Tensor, kind: str,
                     temperature: float = 1.0, beta: float = 0.5) -> torch.Tensor:
    """Divergence `kind` (one of DIVERGENCES) per row between softmax(teacher / tau) and
    softmax(student / tau), logits (N, V) -> (N,) float32."""
    if kind not in DIVERGENCES:
        raise ValueError(f"divergence must be one of {', '.join(DIVERGENCES)}, got {kind!r}")
    if temperature <= 0:
        raise ValueError(f"the distillation temperature must be > 0, got {temperature}")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student logits {tuple(student_logits.shape)} and teacher logits "
                         f"{tuple(teacher_logits.shape)} differ in shape: both models must score the same "
                         "positions over the same vocabulary")
    q = (student_logits.float() / temperature).log_softmax(-1)  # (N, V)
    p = (teacher_logits.float() / temperature).log_softmax(-1)  # (N, V)
    if kind == "fkl":
        return forward_kl(q, p)
    if kind == "rkl":
        return reverse_kl(q, p)
    if kind == "jsd":
        return generalized_jsd(q, p, beta)
    return total_variation(q, p)


def masked_divergence(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor,
                      kind: str, temperature: float = 1.0, beta: float = 0.5) -> torch.Tensor:
    """Mean of `token_divergence` over the positions `mask` (B, T) keeps, logits (B, T, V) -> ().

    Only the kept rows are normalised (the vocabulary-wide work is done for answer tokens only).
    A mask that keeps nothing gives 0 (connected to the student's graph, so backward still runs).
    """
    if mask.shape != student_logits.shape[:-1]:
        raise ValueError(f"mask {tuple(mask.shape)} must have the logits' leading shape "
                         f"{tuple(student_logits.shape[:-1])}")
    if not bool(mask.any()):
        return student_logits.sum() * 0.0
    values = token_divergence(student_logits[mask], teacher_logits[mask], kind, temperature, beta)  # (N,)
    return values.mean()
