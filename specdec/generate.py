"""specdec.generate: plain or speculative decoding through one entry point; specdec.stream: the
same decoding as an iterator of the tokens each step accepts.

Streaming follows transformers' streamer protocol: `generate(..., streamer=s)` calls
`s.put(prompt_ids)` once with the (1, T) prompt, then `s.put(new_ids)` with the tokens of each
step as it accepts them, and `s.end()` at the end, so `transformers.TextStreamer` and
`TextIteratorStreamer` work as with transformers' own generate (one row only, as there).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from runtime.args import check_generator, check_instance, check_int, check_methods, check_model, same_device
from specdec.capture import DecodeObserver
from specdec.decode import decode, decode_steps
from specdec.loader import as_runtime_model, draft_length_of, make_drafter
from specdec.options import DEFAULT_NUM_DRAFT_TOKENS, check_draft_length, parse_draft_length
from specdec.rows import RowState, eos_set, normalize_prompts, unwrap_encoding
from specdec.sampling import RowSampling, SamplingParams
from specdec.stats import AcceptanceStats


@dataclass
class GenerateOutput:
    """sequences: LongTensor [B, T + new] for a tensor input (short rows padded with `pad_token_id`),
    or a list of 1-D LongTensors (prompt + new) for a list input; stats: AcceptanceStats. The
    target's hidden states behind the tokens are recorded by an observer
    (`generate(observer=specdec.capture.StateCapture(...))`)."""

    sequences: torch.Tensor | list[torch.Tensor]
    stats: AcceptanceStats


@torch.inference_mode()
def generate(target, input_ids, draft=None, max_new_tokens: int = 128, temperature: float = 0.0,
             top_p: float = 1.0, top_k: int = 0, num_draft_tokens: int | str = DEFAULT_NUM_DRAFT_TOKENS,
             eos_token_id: int | list[int] | None = None, generator: torch.Generator | None = None,
             pad_token_id: int | None = None, attention_mask: torch.Tensor | None = None, streamer=None,
             observer: DecodeObserver | list[DecodeObserver] | None = None) -> GenerateOutput:
    """Generate up to `max_new_tokens` per row, plainly (draft=None) or speculatively.

    target: a runtime model or a transformers PreTrainedModel. input_ids: LongTensor [B, T] or a
    list of 1-D LongTensors (rows of different lengths; each row stops on its own), or a tokenizer's
    output (a BatchEncoding: its input_ids and attention_mask); a padded
    [B, T] batch takes its `attention_mask` (1 = token, 0 = padding) and `pad_token_id`, which
    also pads the output rows. draft: None,
    a runtime / transformers model sharing the target's vocabulary, a drafter spec (the strings of
    `specdec eval --methods` and `specdec serve --draft`: "ngram", "draft:NAME@4", "eagle:DIR@48",
    "ngram+draft:NAME", ...; specdec.methods), Medusa heads, an EAGLE-3 head, a
    `specdec.drafter.Drafter`, or a list tried in order per step (["ngram", draft_model] =
    hybrid). num_draft_tokens: drafts per step (1-64) or "auto" (tuned per step for speed; trees
    such as Medusa's keep their own shape; a spec's own @K replaces it). temperature, top_p and
    top_k (checked as a specdec.SamplingParams): temperature 0 = greedy
    (output equals plain decoding); otherwise lossless rejection sampling with top_k / top_p
    applied identically to draft and target. generator: the torch.Generator for every random
    choice. eos_token_id: one id or several.
    observer: a `specdec.capture.DecodeObserver` (or a list) that sees the target's outputs behind
    each row's tokens, from the same forwards: `StateCapture(hidden=True)` records the hidden
    states Medusa heads train on (distill.data.features), `StateCapture(aux_layers=...)` the aux
    layers' states an EAGLE-3 head trains on (with an EAGLE-3 drafter, its own layers).
    streamer: a transformers-style streamer (`put` / `end`, e.g. `TextStreamer(tok)`) that gets
    the prompt, then each step's accepted tokens as they come; one row only.

    Every argument is checked before anything runs: a wrong type raises TypeError, a bad value
    ValueError, each naming the argument (`runtime.args`); max_new_tokens is an integer >= 1, as in
    transformers' generate.
    """
    if streamer is not None:
        check_methods("streamer", streamer, ("put", "end"), "a transformers-style streamer (e.g. TextStreamer(tok))")
    observers = _observers(observer)
    num_draft_tokens = parse_draft_length(draft_length_of(draft, check_draft_length(num_draft_tokens)))
    target, drafter, state, as_tensor = _prepare(target, input_ids, draft, max_new_tokens, temperature, top_p,
                                                 top_k, eos_token_id, generator, pad_token_id, attention_mask)
    rows = state.prompts
    if streamer is not None and len(rows) != 1:
        raise ValueError(f"a streamer follows one row, but input_ids holds {len(rows)}; stream one prompt per "
                         "call, or serve several with specdec.serving.engine.Engine")
    on_tokens = None
    if streamer is not None:
        streamer.put(rows[0][None])  # (1, T), as transformers does

        def on_tokens(emitted: list[list[int]]) -> None:
            if emitted[0]:
                streamer.put(torch.tensor(emitted[0], dtype=torch.long))  # (n,): the step's accepted tokens
    stats = decode(target, drafter, state, num_draft_tokens, temperature, top_k, top_p, generator, on_tokens,
                   observers)
    if streamer is not None:
        streamer.end()
    seqs = state.sequences()
    if as_tensor:
        pad = pad_token_id if pad_token_id is not None else (min(state.eos) if state.eos else 0)
        width = max(s.numel() for s in seqs)
        out = torch.full((len(seqs), width), pad, dtype=torch.long)
        for b, s in enumerate(seqs):
            out[b, :s.numel()] = s
        return GenerateOutput(out, stats)
    return GenerateOutput(seqs, stats)


def _prepare(target, input_ids, draft, max_new_tokens: int, temperature: float, top_p: float, top_k: int,
             eos_token_id, generator: torch.Generator | None, pad_token_id: int | None,
             attention_mask: torch.Tensor | None):
    """Checked arguments of generate() / stream() -> (target, drafter, RowState, as_tensor)."""
    max_new_tokens = check_int("max_new_tokens", max_new_tokens, minimum=1)  # as transformers' generate
    SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)  # checks them
    check_int("pad_token_id", pad_token_id, optional=True)
    eos = eos_set(eos_token_id)
    if getattr(target, "output_ids", None) is not None:
        raise ValueError("the target scores a restricted vocabulary (specdec.drafters.draft_vocab.restrict_vocab): "
                         "such a model can only draft; pass the full model as the target")
    target = as_runtime_model(target)
    check_model("target", target)
    check_generator("generator", generator, target.device)
    _check_eos_vocab(eos, target.config.vocab_size)
    input_ids, attention_mask = unwrap_encoding(input_ids, attention_mask)
    _check_ids_device(input_ids, target.device)
    rows, as_tensor = normalize_prompts(input_ids, attention_mask, pad_token_id)
    state = RowState(rows, max_new_tokens, eos)
    drafter = None if draft is None else make_drafter(draft, target, temperature, top_k, top_p, generator)
    return target, drafter, state, as_tensor


def _check_eos_vocab(eos: frozenset[int], vocab_size: int) -> None:
    """ValueError for a stop token outside the model's vocabulary: it could never be generated."""
    outside = sorted(e for e in eos if e >= vocab_size)
    if outside:
        raise ValueError(f"eos_token_id {outside[0]} is outside the model's vocabulary [0, {vocab_size}), so it could "
                         "never stop a row; pass the tokenizer's eos_token_id")


def _check_ids_device(input_ids, device: torch.device) -> None:
    """ValueError for input_ids (a tensor, or a list's tensor rows) on an accelerator other than the
    model's device. Ids on the CPU, where tokenizers put them, go with a model on any device."""
    tensors = [input_ids] if isinstance(input_ids, torch.Tensor) else \
        [r for r in input_ids if isinstance(r, torch.Tensor)] if isinstance(input_ids, (list, tuple)) else []
    for t in tensors:
        if t.device.type not in ("cpu", "meta") and not same_device(t.device, device):
            raise ValueError(f"input_ids is on {t.device} but the model runs on {device}; move them there with "
                             f"input_ids.to({str(device)!r}) (or pass them on the CPU)")


def _observers(observer) -> list[DecodeObserver]:
    """generate()'s observer argument as a list: None, one DecodeObserver, or a list of them."""
    observers = [] if observer is None else list(observer) if isinstance(observer, (list, tuple)) else [observer]
    for o in observers:
        check_instance("observer", o, DecodeObserver,
                       "a specdec.capture.DecodeObserver (e.g. StateCapture(hidden=True)), a list of them, or None")
    return observers


def stream(target, input_ids, draft=None, max_new_tokens: int = 128, temperature: float = 0.0,
           top_p: float = 1.0, top_k: int = 0, num_draft_tokens: int | str = DEFAULT_NUM_DRAFT_TOKENS,
           eos_token_id: int | list[int] | None = None,
           generator: torch.Generator | None = None) -> Iterator[list[int]]:
    """generate() as an iterator: yields, step by step, the new token ids of one prompt that each
    step accepted (the first token, then 1 to k + 1 per speculative step; empty steps are
    skipped). Arguments as generate(); input_ids holds one prompt ((T,), (1, T) or a list of one).
    The arguments are checked at the call; decoding runs as the iterator is consumed.

        for ids in specdec.stream(model, prompt_ids, draft="ngram", eos_token_id=tok.eos_token_id):
            print(tok.decode(ids), end="", flush=True)
    """
    num_draft_tokens = parse_draft_length(draft_length_of(draft, check_draft_length(num_draft_tokens)))
    target, drafter, state, _ = _prepare(target, input_ids, draft, max_new_tokens, temperature, top_p, top_k,
                                         eos_token_id, generator, None, None)
    if len(state.prompts) != 1:
        raise ValueError(f"stream() follows one prompt, but input_ids holds {len(state.prompts)}; serve several "
                         "with specdec.serving.engine.Engine")
    stats = AcceptanceStats(num_calls=1)
    sampling = RowSampling(SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k), generator)
    steps = decode_steps(target, drafter, state, num_draft_tokens, sampling, stats)

    def tokens() -> Iterator[list[int]]:
        while True:
            with torch.inference_mode():  # per step: the caller's code between steps keeps its own mode
                emitted = next(steps, None)
            if emitted is None:
                return
            if emitted[0]:
                yield emitted[0]

    return tokens()
