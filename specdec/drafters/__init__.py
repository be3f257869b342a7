"""The drafters that ship with specdec, one file each, and `make_drafter` for generate()'s `draft=`.

Every drafter implements `specdec.drafter.Drafter`: a draft model (`ModelDrafter`), n-gram
prompt lookup (`NgramDrafter`), a list tried in order (`HybridDrafter`), Medusa heads
(`MedusaDrafter`) and EAGLE-3 heads (`EagleDrafter`).
"""

from __future__ import annotations

import torch

from specdec.drafter import Drafter
from specdec.drafters.eagle import EagleDrafter, EagleTreeConfig
from specdec.drafters.hybrid import HybridDrafter
from specdec.drafters.medusa import MedusaDrafter
from specdec.drafters.model import ModelDrafter, VocabularyMismatchError, check_vocabularies
from specdec.drafters.ngram import NgramDrafter
from specdec.eagle import Eagle3Head
from specdec.medusa import MedusaHeads

__all__ = ["Drafter", "EagleDrafter", "EagleTreeConfig", "HybridDrafter", "MedusaDrafter", "ModelDrafter",
           "NgramDrafter", "VocabularyMismatchError", "check_vocabularies", "make_drafter"]


def make_drafter(draft, target, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 generator: torch.Generator | None = None) -> Drafter:
    """The drafter for generate()'s `draft` argument: a Drafter (used as is), "ngram", Medusa
    heads, an EAGLE-3 head or "eagle:PATH" (a head directory, `specdec.load_eagle`), a runtime or
    transformers model, or a list of chain drafters tried in order."""
    if isinstance(draft, Drafter):
        return draft
    if isinstance(draft, (list, tuple)):
        return HybridDrafter([make_drafter(d, target, temperature, top_k, top_p, generator) for d in draft])
    if isinstance(draft, str):
        if draft == "ngram":
            return NgramDrafter()
        if draft.startswith("eagle:") and len(draft) > len("eagle:"):
            from specdec.eagle_io import load_eagle

            return EagleDrafter(load_eagle(draft[len("eagle:"):], target), target)
        raise ValueError(f"unknown draft {draft!r}: pass a model, 'ngram', 'eagle:PATH', Medusa heads or a list "
                         "(to draft with a checkpoint, load it first: runtime.load_model(name))")
    if isinstance(draft, MedusaHeads):
        return MedusaDrafter(draft, target)
    if isinstance(draft, Eagle3Head):
        return EagleDrafter(draft, target)
    if not isinstance(draft, torch.nn.Module) or not hasattr(draft, "config"):
        raise TypeError(f"draft must be None, 'ngram', a model, Medusa or EAGLE-3 heads, a specdec Drafter or a "
                        f"list of those, got {type(draft).__name__}")
    from specdec.generate import as_runtime_model

    return ModelDrafter(as_runtime_model(draft), target, temperature, top_k, top_p, generator)
