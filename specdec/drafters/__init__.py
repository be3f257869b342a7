"""The drafters that ship with specdec, one file each, and `make_drafter` for generate()'s `draft=`.

Every drafter implements `specdec.drafter.Drafter`: a draft model (`ModelDrafter`), n-gram
prompt lookup (`NgramDrafter`), suffix decoding (`SuffixDrafter`), a list tried in order
(`HybridDrafter`), several chosen per step (`CompositeDrafter`), Medusa heads (`MedusaDrafter`)
and EAGLE-3 heads (`EagleDrafter`). A string names one in the grammar of
`specdec.drafters.spec.DrafterSpec` (its registry `DRAFTERS` lists the kinds).
"""

from __future__ import annotations

import torch

from specdec.drafter import Drafter
from specdec.drafters.composite import CompositeDraft, CompositeDrafter
from specdec.drafters.eagle.drafter import EagleDrafter, EagleTreeConfig
from specdec.drafters.eagle.head import Eagle3Head
from specdec.drafters.hybrid import HybridDrafter
from specdec.drafters.medusa.drafter import MedusaDrafter
from specdec.drafters.medusa.heads import MedusaHeads
from specdec.drafters.model import DraftModel, ModelDrafter, VocabularyMismatchError, check_vocabularies
from specdec.drafters.ngram import NgramDrafter
from specdec.drafters.spec import DRAFTERS, DrafterLoader, DrafterSpec
from specdec.drafters.suffix import SuffixCache, SuffixConfig, SuffixDrafter

__all__ = ["DRAFTERS", "CompositeDrafter", "DraftModel", "Drafter", "DrafterLoader", "DrafterSpec", "EagleDrafter",
           "EagleTreeConfig", "HybridDrafter", "MedusaDrafter", "ModelDrafter", "NgramDrafter", "SuffixCache",
           "SuffixConfig", "SuffixDrafter", "VocabularyMismatchError", "check_vocabularies", "draft_length_of",
           "make_drafter"]


def make_drafter(draft, target, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 generator: torch.Generator | None = None, loader: DrafterLoader | None = None) -> Drafter:
    """The drafter for generate()'s `draft` argument: a Drafter (used as is), a spec string such as
    "ngram", "draft:NAME@4" or "eagle:DIR@48" (a DrafterSpec or its text; what it names is loaded
    by `loader`; its own draft length is the caller's to apply, see `draft_length_of`), Medusa
    heads, an EAGLE-3 head, a runtime or transformers model, or a list of those tried in order."""
    from specdec.generate import as_runtime_model

    if isinstance(draft, Drafter):
        return draft
    if isinstance(draft, CompositeDraft):
        return CompositeDrafter([make_drafter(d, target, temperature, top_k, top_p, generator, loader) for d in draft],
                                draft.records)
    if isinstance(draft, DraftModel):
        return ModelDrafter(as_runtime_model(draft.model), target, temperature, top_k, top_p, generator, draft.p_min)
    if isinstance(draft, (list, tuple)):
        return HybridDrafter([make_drafter(d, target, temperature, top_k, top_p, generator, loader) for d in draft])
    if isinstance(draft, str) and draft == "ngram":
        return NgramDrafter()
    if isinstance(draft, (str, DrafterSpec)):
        spec = DrafterSpec.parse(draft) if isinstance(draft, str) else draft
        return make_drafter(spec.load(target, loader), target, temperature, top_k, top_p, generator)
    if isinstance(draft, MedusaHeads):
        return MedusaDrafter(draft, target)
    if isinstance(draft, Eagle3Head):
        return EagleDrafter(draft, target)
    if not isinstance(draft, torch.nn.Module) or not hasattr(draft, "config"):
        raise TypeError(f"draft must be None, a drafter spec ('ngram', 'draft:NAME', 'eagle:DIR', ...), a model, "
                        f"Medusa or EAGLE-3 heads, a specdec Drafter or a list of those, got {type(draft).__name__}")
    return ModelDrafter(as_runtime_model(draft), target, temperature, top_k, top_p, generator)


def draft_length_of(draft, num_draft_tokens: int | str) -> int | str:
    """The draft length a step uses with `draft`: a spec's own (its @K, e.g. "ngram@3") in place of
    `num_draft_tokens`, else `num_draft_tokens`."""
    if isinstance(draft, str) and draft != "ngram":
        draft = DrafterSpec.parse(draft)
    own = draft.draft_length if isinstance(draft, DrafterSpec) else None
    return num_draft_tokens if own is None else own
