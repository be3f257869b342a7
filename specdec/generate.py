"""specdec.generate: plain or speculative decoding through one entry point."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.decode import decode
from specdec.drafters import make_drafter
from specdec.options import check_sampling, parse_draft_length
from specdec.rows import RowState, eos_set, normalize_prompts
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


@torch.inference_mode()
def generate(target, input_ids, draft=None, max_new_tokens: int = 128, temperature: float = 0.0,
             top_p: float = 1.0, top_k: int = 0, num_draft_tokens: int | str = 5,
             eos_token_id: int | list[int] | None = None, generator: torch.Generator | None = None,
             pad_token_id: int | None = None, return_hidden: bool = False,
             attention_mask: torch.Tensor | None = None) -> GenerateOutput:
    """Generate up to `max_new_tokens` per row, plainly (draft=None) or speculatively.

    target: a runtime model or a transformers PreTrainedModel. input_ids: LongTensor [B, T] or a
    list of 1-D LongTensors (rows of different lengths; each row stops on its own); a padded
    [B, T] batch takes its `attention_mask` (1 = token, 0 = padding) and `pad_token_id`, which
    also pads the output rows. draft: None,
    a runtime / transformers model sharing the target's vocabulary, "ngram", Medusa heads, a
    `specdec.drafter.Drafter`, or a list tried in order per step (["ngram", draft_model] =
    hybrid). num_draft_tokens: drafts per step (1-64) or "auto" (tuned per step for speed; trees
    such as Medusa's keep their own shape). temperature 0 = greedy
    (output equals plain decoding); otherwise lossless rejection sampling with top_k / top_p
    applied identically to draft and target. generator: the torch.Generator for every random
    choice. eos_token_id: one id or several. return_hidden: also return the target's hidden
    states behind each new token (what Medusa heads train on, see distill.selfdistill).
    """
    check_sampling(temperature, top_p, top_k)
    num_draft_tokens = parse_draft_length(num_draft_tokens)
    if getattr(target, "output_ids", None) is not None:
        raise ValueError("the target scores a restricted vocabulary (specdec.draft_vocab.restrict_vocab): "
                         "such a model can only draft; pass the full model as the target")
    target = as_runtime_model(target)
    if generator is not None and generator.device.type != target.device.type:
        raise ValueError(f"the generator is on {generator.device} but the target runs on {target.device}; "
                         f"create it with torch.Generator(device={str(target.device)!r})")
    rows, as_tensor = normalize_prompts(input_ids, attention_mask, pad_token_id)
    state = RowState(rows, max_new_tokens, eos_set(eos_token_id))
    drafter = None if draft is None else make_drafter(draft, target, temperature, top_k, top_p, generator)
    hidden = [[] for _ in rows] if return_hidden else None
    stats = decode(target, drafter, state, num_draft_tokens, temperature, top_k, top_p, generator, hidden)
    seqs = state.sequences()
    if hidden is not None:  # per row (n, C): the states that chose its n new tokens
        empty = torch.zeros(0, target.config.hidden_size, dtype=target.dtype, device=target.device)
        hidden = [torch.stack(h) if h else empty for h in hidden]
    if as_tensor:
        pad = pad_token_id if pad_token_id is not None else (min(state.eos) if state.eos else 0)
        width = max(s.numel() for s in seqs)
        out = torch.full((len(seqs), width), pad, dtype=torch.long)
        for b, s in enumerate(seqs):
            out[b, :s.numel()] = s
        return GenerateOutput(out, stats, hidden)
    return GenerateOutput(seqs, stats, hidden)
