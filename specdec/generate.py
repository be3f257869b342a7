"""specdec.generate: plain or speculative decoding through one entry point."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from specdec.rows import RowState, check_lengths, eos_set, normalize_prompts, prefill
from specdec.sampling import select_next
from specdec.stats import AcceptanceStats


@dataclass
class GenerateOutput:
    """sequences: LongTensor [B, T + new] for a tensor input (short rows padded with `pad_token_id`),
    or a list of 1-D LongTensors (prompt + new) for a list input; stats: AcceptanceStats;
    hidden_states (with `return_hidden`): per row, the final-norm hidden states (n, C) that chose
    its n new tokens (those of its last prompt token and of every new token but the last)."""

    sequences: torch.Tensor | list[torch.Tensor]
    stats: AcceptanceStats
    hidden_states: list[torch.Tensor] | None = None


def as_runtime_model(model):
    """The model itself, or an HFAdapter around a transformers PreTrainedModel."""
    from transformers import PreTrainedModel

    if isinstance(model, PreTrainedModel):
        from runtime.hf_adapter import HFAdapter

        return HFAdapter(model)
    return model


def _check_sampling(temperature: float, top_p: float, top_k: int) -> None:
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")


@torch.inference_mode()
def generate(target, input_ids, draft=None, max_new_tokens: int = 128, temperature: float = 0.0,
             top_p: float = 1.0, top_k: int = 0, num_draft_tokens: int | str = 5,
             eos_token_id: int | list[int] | None = None, generator: torch.Generator | None = None,
             pad_token_id: int | None = None, return_hidden: bool = False) -> GenerateOutput:
    """Generate up to `max_new_tokens` per row, plainly (draft=None) or speculatively.

    target: a runtime model or a transformers PreTrainedModel. input_ids: LongTensor [B, T] or a
    list of 1-D LongTensors (rows of different lengths; each row stops on its own). draft: None,
    a runtime / transformers model sharing the target's vocabulary, "ngram", Medusa heads, or a
    list tried in order per step (["ngram", draft_model] = hybrid). temperature 0 = greedy
    (output equals plain decoding); otherwise lossless rejection sampling with top_k / top_p
    applied identically to draft and target. generator: the torch.Generator for every random
    choice. eos_token_id: one id or several. return_hidden: also return the hidden states behind
    each new token (plain decoding only; what Medusa heads train on, see distill.selfdistill).
    """
    _check_sampling(temperature, top_p, top_k)
    if return_hidden and draft is not None:
        raise ValueError("return_hidden is for plain decoding (draft=None): a speculative step's hidden "
                         "states include those of rejected draft tokens")
    if getattr(target, "output_ids", None) is not None:
        raise ValueError("the target scores a restricted vocabulary (specdec.draft_vocab.restrict_vocab): "
                         "such a model can only draft; pass the full model as the target")
    target = as_runtime_model(target)
    rows, as_tensor = normalize_prompts(input_ids)
    state = RowState(rows, max_new_tokens, eos_set(eos_token_id))
    hidden = [] if return_hidden else None
    if draft is None:
        stats = _plain(target, state, temperature, top_k, top_p, generator, hidden)
    elif getattr(draft, "is_tree_drafter", False):
        from specdec.medusa import medusa_decode

        stats = medusa_decode(target, draft, state, temperature, top_k, top_p, generator)
    else:
        from specdec.speculative import speculative_decode

        stats = speculative_decode(target, draft, state, num_draft_tokens, temperature, top_k, top_p,
                                   generator)
    seqs = state.sequences()
    if hidden is not None:  # steps (B, C) -> per row, the steps that chose its tokens (n, C)
        steps = torch.stack(hidden, 1) if hidden else torch.zeros(
            len(seqs), 0, target.config.hidden_size, dtype=target.dtype, device=target.device)
        hidden = [steps[b, :len(new)] for b, new in enumerate(state.new)]
    if as_tensor:
        pad = pad_token_id if pad_token_id is not None else (min(state.eos) if state.eos else 0)
        width = max(s.numel() for s in seqs)
        out = torch.full((len(seqs), width), pad, dtype=torch.long)
        for b, s in enumerate(seqs):
            out[b, :s.numel()] = s
        return GenerateOutput(out, stats, hidden)
    return GenerateOutput(seqs, stats, hidden)


def _plain(model, state: RowState, temperature: float, top_k: int, top_p: float,
           generator: torch.Generator | None, hidden: list[torch.Tensor] | None = None) -> AcceptanceStats:
    """Plain decoding: one target forward per token (tau = 1). `hidden`: a list that receives each
    step's hidden states (B, C), the prompt's last token first."""
    cfg = model.config
    stats = AcceptanceStats(num_calls=1)
    max_len = check_lengths(state.prompts, state.max_new_tokens, cfg.max_position_embeddings,
                            cfg.vocab_size)
    if state.all_done:
        return stats
    start = time.perf_counter()
    cache = model.new_cache(len(state.prompts), max_len)
    logits = prefill(model, state.prompts, cache, return_hidden=hidden is not None)  # (B, V)
    if hidden is not None:
        logits, h = logits
        hidden.append(h)  # (B, C)
    while True:
        active = state.active()
        nxt = select_next(logits, temperature, top_k, top_p, generator).cpu()  # (B,)
        stats.target_forwards += len(active)
        for b in active:
            stats.generated_tokens += state.emit(b, [int(nxt[b])])
        if stats.ttft_s == 0.0:
            stats.ttft_s = time.perf_counter() - start
        if state.all_done:
            break
        tokens = nxt.to(model.device)[:, None]  # (B, 1)
        positions = cache.lengths[:, None].clone()  # (B, 1): slot == position in plain decoding
        if hidden is None:
            logits = model(tokens, positions, cache)[:, -1]  # (B, V)
        else:
            logits, h = model(tokens, positions, cache, return_hidden=True)
            logits = logits[:, -1]
            hidden.append(h[:, -1])  # (B, C)
    stats.wall_s = time.perf_counter() - start
    per_row = max(len(n) for n in state.new)
    stats.tpot_s = (stats.wall_s - stats.ttft_s) / (per_row - 1) if per_row > 1 else 0.0
    stats.verify_s = stats.wall_s
    return stats
