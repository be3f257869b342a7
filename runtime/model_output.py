"""ModelOutput: what every forward of a runtime model returns, whatever it was asked for.

One fixed record instead of a tuple whose length follows the flags: callers read `out.logits`,
`out.hidden`, `out.aux` by name. A NamedTuple, so `torch.compile` passes it through a compiled
step as it does a tuple (`Transformer.static_step`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class ModelOutput(NamedTuple):
    """logits (B, T|N, V): every position's, or only those `logits_idx` (B, N) picked.
    hidden (B, T, C): the final hidden states (after the final norm); None unless `return_hidden`.
    aux (B, T, len(aux_layers) * C): the states entering each of `aux_layers` (layer i's input,
    0 = the embedding: vLLM's numbering of EAGLE-3's auxiliary states), concatenated in the order
    given; None unless `aux_layers` named some."""

    logits: torch.Tensor
    hidden: torch.Tensor | None = None
    aux: torch.Tensor | None = None


def check_aux_layers(layers, num_layers: int) -> tuple[int, ...]:
    """`layers` as a tuple of layer ids in 0..num_layers-1 (repeats and any order allowed; () = none),
    or a ValueError that names `aux_layers` and the valid range."""
    layers = tuple(layers)
    if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers for i in layers):
        raise ValueError(f"aux_layers must be layer ids in 0..{num_layers - 1} (this model has {num_layers} "
                         f"layers), got {layers!r}")
    return layers
