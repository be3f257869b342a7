"""Training sequences for draft distillation: whose answers the draft learns on, and their batches.

DistillSpec (Zhou et al. 2023) trains the draft on sequences it generates itself (on-policy),
scored position by position by the target, so the draft learns where it actually goes wrong
while drafting. Three sources (`DATA_SOURCES`):

    on-policy  the draft's own answers, sampled at `sample_temperature` (the default)
    target     the target's answers (greedy at target_temperature 0, else sampled)
    mixed      each batch on-policy with probability lambda, else the target's (GKD's lambda)

Answers come from `specdec.generate` (batched rows of different lengths, an explicit
torch.Generator). `make_batch` right-pads prompt + answer rows and lists, per row, the positions
whose next token is an answer token: the only positions the divergence scores, and the only
ones whose logits either model computes (`logits_idx`), which keeps the full-vocabulary work at
the answer tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

import specdec
from distill.data.code_prompts import function_prompts, interleave
from distill.data.selfdistill import sharegpt_prompts

DATA_SOURCES = ("on-policy", "target", "mixed")


def batch_source(data: str, mixed_lambda: float, generator: torch.Generator) -> str:
    """Whose answers one batch uses: "draft" or "target" (for "mixed", "draft" with probability lambda)."""
    if data not in DATA_SOURCES:
        raise ValueError(f"data must be one of {', '.join(DATA_SOURCES)}, got {data!r}")
    if data == "mixed":
        return "draft" if float(torch.rand((), generator=generator)) < mixed_lambda else "target"
    return "draft" if data == "on-policy" else "target"


def sample_answers(model, prompts: list[list[int]], max_new_tokens: int, temperature: float,
                   generator: torch.Generator, eos_token_id: int | list[int] | None = None) -> list[list[int]]:
    """The answer ids `model` generates for each prompt (one batched `specdec.generate` call; a row
    stops at eos, whose token is kept). temperature 0 = greedy, else sampled with `generator`."""
    rows = [torch.tensor(p, dtype=torch.long) for p in prompts]
    out = specdec.generate(model, rows, max_new_tokens=max_new_tokens, temperature=temperature,
                           eos_token_id=eos_token_id, generator=generator)
    return [seq[len(p):].tolist() for p, seq in zip(prompts, out.sequences)]


@dataclass
class DistillBatch:
    """Right-padded rows and the positions to score.

    tokens, positions: (B, T). idx (B, N): per row the positions whose next token is an answer
    token (N = the longest answer; shorter rows repeat their last index); valid (B, N) marks the
    real ones. answer_tokens: how many answer tokens the batch scores."""

    tokens: torch.Tensor
    positions: torch.Tensor
    idx: torch.Tensor
    valid: torch.Tensor

    @property
    def answer_tokens(self) -> int:
        return int(self.valid.sum())

    def to(self, device: torch.device) -> DistillBatch:
        return DistillBatch(*(t.to(device) for t in (self.tokens, self.positions, self.idx, self.valid)))


def make_batch(prompts: list[list[int]], answers: list[list[int]], pad_id: int = 0) -> DistillBatch:
    """Rows prompt + answer, right-padded with `pad_id` (causal attention: padding after a row's
    end changes nothing before it). A row without an answer scores nothing (valid all False)."""
    if len(prompts) != len(answers) or not prompts:
        raise ValueError(f"need one answer per prompt and at least one row, got {len(prompts)} prompts and "
                         f"{len(answers)} answers")
    if any(not p for p in prompts):
        raise ValueError("a prompt is empty: every row needs at least one prompt token")
    rows = [list(p) + list(a) for p, a in zip(prompts, answers)]
    B, T = len(rows), max(len(r) for r in rows)
    N = max(1, max(len(a) for a in answers))
    tokens = torch.full((B, T), pad_id, dtype=torch.long)  # (B, T)
    idx = torch.zeros(B, N, dtype=torch.long)  # (B, N)
    valid = torch.zeros(B, N, dtype=torch.bool)  # (B, N)
    for b, (p, a) in enumerate(zip(prompts, answers)):
        tokens[b, :len(rows[b])] = torch.tensor(rows[b], dtype=torch.long)
        first = len(p) - 1  # the last prompt position predicts the first answer token
        n = len(a)
        idx[b, :n] = torch.arange(first, first + n)
        idx[b, n:] = first + max(n - 1, 0)
        valid[b, :n] = True
    positions = torch.arange(T)[None].expand(B, -1).contiguous()  # (B, T)
    return DistillBatch(tokens, positions, idx, valid)


def training_prompts(tokenizer, num_prompts: int = 2000, max_prompt_tokens: int = 256, code_share: float = 0.25,
                     stub_cache: str | Path | None = None) -> list[tuple[int, list[int]]]:
    """Chat and code prompts to distil on: opening user turns of the first `num_prompts` ShareGPT
    *calibration* conversations, interleaved with function stubs cut from this machine's Python
    sources (HumanEval-shaped, distill.data.code_prompts) at `code_share`; each fits `max_prompt_tokens`
    once formatted with the chat template. stub_cache: a JSON file keeping the stubs between runs."""
    chat = sharegpt_prompts(tokenizer, split="calibration", limit=num_prompts, max_prompt_tokens=max_prompt_tokens)
    if code_share <= 0:
        return chat
    stubs = function_prompts(tokenizer, limit=round(len(chat) * code_share / max(1e-9, 1 - code_share)) + 1,
                             max_prompt_tokens=max_prompt_tokens, cache=stub_cache)
    return interleave(stubs, chat, code_share)


def heldout_prompts(tokenizer, count: int = 8, max_prompt_tokens: int = 256) -> list[list[int]]:
    """`count` prompts for the held-out acceptance measurement: the *last* usable opening turns of
    ShareGPT's held-out slice, so evaluations (which read that slice from its start) score others."""
    if count < 1:
        return []
    return [ids for _, ids in sharegpt_prompts(tokenizer, split="heldout", limit=None,
                                               max_prompt_tokens=max_prompt_tokens)[-count:]]
