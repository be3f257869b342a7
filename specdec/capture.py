"""Observers of the decode loop: what the target computed for the tokens a decode emits.

A `DecodeObserver` passed to `specdec.generate(..., observer=...)` (or to `DecodeLoop`) says which
of the target's states it reads (`return_hidden`, `aux_layers`); the loop asks the target's
forwards for them and hands each row's share to the observer, after the prefill and after every
step, from the same forwards that decode (no second pass). `StateCapture` is the observer that
records them as training data: the final hidden states for Medusa heads (`distill.data.features`),
the aux layers' states for an EAGLE-3 head (`distill.data.features`).

    capture = StateCapture(hidden=True, aux_layers=(2, 15, 27))
    out = specdec.generate(model, prompts, observer=capture)
    capture.hidden_states[b]  # (n, C): the states that chose row b's n new tokens
    capture.aux_states[b]     # (T + n - 1, 3C): every position row b's target read
"""

from __future__ import annotations

import torch

from runtime.model_output import ModelOutput


class DecodeObserver:
    """Watches a decode loop's target forwards; every hook does nothing unless overridden.

    return_hidden: the loop's target forwards compute the final hidden states for it.
    aux_layers: the target layers whose entering states it reads (a runtime Transformer's
    numbering, `Transformer.forward(aux_layers=...)`); () = none. With a drafter that reads layers
    (EAGLE-3), they must be the drafter's own: the forward computes one set.
    """

    return_hidden: bool = False
    aux_layers: tuple[int, ...] = ()

    def on_start(self, target, batch_size: int) -> None:
        """The loop starts over `batch_size` cache rows of `target`."""

    def on_prefill(self, row: int, prompt: torch.Tensor, out: ModelOutput) -> None:
        """`row` read `prompt` (T,) and emitted its first token. out: logits (1, V) and hidden
        (1, C) at the last prompt position (the one that chose the token), aux (T, nC) at every
        prompt position; a field that neither an observer nor the drafter asked for is None. A row
        reused for a new prompt (the serving engine) starts here again."""

    def on_step(self, row: int, out: ModelOutput) -> None:
        """`row` emitted n >= 1 tokens in one step. out: logits (n, V), hidden (n, C), aux (n, nC) at
        the n positions whose outputs chose them (the step's root, then its accepted drafts)."""


class StateCapture(DecodeObserver):
    """Records, per row, the target's states behind the tokens a decode emits.

    hidden: record the final hidden states; aux_layers: record the states entering these layers.
    After the decode: `hidden_states[b]` (n, C), the states that chose row b's n new tokens (those
    of its last prompt token and of every new token but the last); `aux_states[b]`
    (T + n - 1, len(aux_layers) * C), the states at every position the target read: the T prompt
    tokens and every new token but the last (what an EAGLE-3 head trains on). None when not asked.
    """

    def __init__(self, hidden: bool = False, aux_layers: tuple[int, ...] | None = None) -> None:
        self.return_hidden = hidden
        self.aux_layers = tuple(aux_layers or ())
        self._hidden: list[list[torch.Tensor]] = []
        self._aux: list[list[torch.Tensor]] = []
        self._empty_hidden = self._empty_aux = None

    def on_start(self, target, batch_size: int) -> None:
        C = target.config.hidden_size
        self._hidden = [[] for _ in range(batch_size)]
        self._aux = [[] for _ in range(batch_size)]
        self._empty_hidden = torch.zeros(0, C, dtype=target.dtype, device=target.device)
        self._empty_aux = torch.zeros(0, len(self.aux_layers) * C, dtype=target.dtype, device=target.device)

    def on_prefill(self, row: int, prompt: torch.Tensor, out: ModelOutput) -> None:
        self._hidden[row] = [out.hidden] if self.return_hidden else []
        self._aux[row] = [out.aux] if self.aux_layers else []

    def on_step(self, row: int, out: ModelOutput) -> None:
        if self.return_hidden:
            self._hidden[row].append(out.hidden)
        if self.aux_layers:
            self._aux[row].append(out.aux)

    @property
    def hidden_states(self) -> list[torch.Tensor] | None:
        """Per row (n, C); None without `hidden`."""
        if not self.return_hidden:
            return None
        return [torch.cat(h) if h else self._empty_hidden for h in self._hidden]

    @property
    def aux_states(self) -> list[torch.Tensor] | None:
        """Per row (T + n - 1, len(aux_layers) * C); None without `aux_layers`."""
        if not self.aux_layers:
            return None
        return [torch.cat(a) if a else self._empty_aux for a in self._aux]
