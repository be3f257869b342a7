"""Speculative decoding loop: draft, verify all drafts in one target forward, keep the longest
correct prefix plus one token, roll the caches back. Rows of a batch advance independently."""

from __future__ import annotations

import time

import torch

from runtime.compile import DECODE_STATIC_TOKENS
from specdec.autok import AutoK
from specdec.drafters import Proposal, make_drafter
from specdec.rows import RowState, check_lengths, prefill
from specdec.sampling import select_next
from specdec.stats import AcceptanceStats
from specdec.verify import verify_greedy, verify_sampling

MAX_DRAFT_TOKENS = 16
# "auto" on a compiled target: verification blocks of 2..8 tokens share one compiled program
# (runtime.compile.static_tokens); 9..16 would compile another, with its own frozen weights.
MAX_DRAFT_TOKENS_COMPILED = DECODE_STATIC_TOKENS - 1


def _draft_length(num_draft_tokens: int | str, target: torch.nn.Module) -> tuple[int, AutoK | None]:
    if num_draft_tokens == "auto":
        k_max = MAX_DRAFT_TOKENS_COMPILED if getattr(target, "compiled", False) else MAX_DRAFT_TOKENS
        return k_max, AutoK(k_max=k_max)
    if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int):
        raise ValueError(f"num_draft_tokens must be an int >= 1 or 'auto', got {num_draft_tokens!r}")
    if not 1 <= num_draft_tokens <= 64:
        raise ValueError(f"num_draft_tokens must be between 1 and 64, got {num_draft_tokens}")
    return num_draft_tokens, None


def speculative_decode(target, draft, state: RowState, num_draft_tokens: int | str, temperature: float,
                       top_k: int, top_p: float, generator: torch.Generator | None) -> AcceptanceStats:
    """Decode every row of `state` with `draft` proposals verified by `target`; returns stats."""
    k_max, auto = _draft_length(num_draft_tokens, target)
    drafter = make_drafter(draft, target, temperature, top_k, top_p, generator)
    cfg = target.config
    stats = AcceptanceStats(num_calls=1)
    max_len = check_lengths(state.prompts, state.max_new_tokens, cfg.max_position_embeddings,
                            cfg.vocab_size) + k_max + 1
    if state.all_done:
        return stats
    B = len(state.prompts)
    start = time.perf_counter()
    cache = target.new_cache(B, max_len)
    drafter.start(state.prompts, max_len)
    logits = prefill(target, state.prompts, cache)  # (B, V)
    pending = select_next(logits, temperature, top_k, top_p, generator).cpu()  # (B,)
    stats.target_forwards += B
    for b in range(B):
        stats.generated_tokens += state.emit(b, [int(pending[b])])
    stats.ttft_s = time.perf_counter() - start
    seqs = state.sequences()
    while not state.all_done:
        active = state.active()
        budget = torch.zeros(B, dtype=torch.long)  # drafts a row may still use: the bonus is always emitted
        for b in active:
            budget[b] = state.max_new_tokens - len(state.new[b]) - 1
        k = min(auto.choose(drafter.draft_cost) if auto else k_max, int(budget.max()))
        t_draft = time.perf_counter()
        if k > 0:
            prop = drafter.propose(seqs, k, active)
        else:
            prop = Proposal(torch.zeros(B, 0, dtype=torch.long), torch.zeros(B, dtype=torch.long), None)
        lens = torch.minimum(prop.lens, budget)  # (B,)
        t_verify = time.perf_counter()
        stats.draft_s += t_verify - t_draft
        device = target.device
        before = cache.lengths.clone()  # (B,): the pending token goes to slot before[b]
        block = torch.cat([pending[:, None], prop.tokens], dim=1).to(device)  # (B, k+1)
        positions = before[:, None] + torch.arange(k + 1, device=device)  # (B, k+1)
        logits = target(block, positions, cache)  # (B, k+1, V)
        if temperature == 0:
            verdict = verify_greedy(logits, prop.tokens.to(device), lens.to(device))
        else:
            verdict = verify_sampling(logits, prop.tokens.to(device), lens.to(device), 
                                      None if prop.q is None else prop.q.to(device),
                                      temperature, top_k, top_p, generator)
        accepted, nxt = verdict.accepted.cpu(), verdict.next_tokens.cpu()
        target_s = time.perf_counter() - t_verify
        keep = before.clone()
        for b in active:
            a, n = int(accepted[b]), int(lens[b])
            keep[b] += 1 + a
            stats.target_forwards += 1
            stats.drafted_tokens += n
            stats.accepted_tokens += a
            reached = min(a + 1, n)
            stats.record_positions([1] * reached, [1] * a + [0] * (reached - a))
            stats.generated_tokens += state.emit(b, prop.tokens[b, :a].tolist() + [int(nxt[b])])
            if auto is not None:
                auto.observe(a, n, k + 1, target_s)
        cache.rollback(keep)
        pending = nxt
        seqs = state.sequences()
        drafter.sync(seqs)
        stats.verify_s += time.perf_counter() - t_verify
    stats.wall_s = time.perf_counter() - start
    per_row = max(len(n) for n in state.new)
    stats.tpot_s = (stats.wall_s - stats.ttft_s) / (per_row - 1) if per_row > 1 else 0.0
    return stats
