"""The drafters that ship with specdec, one file each; they propose and commit, nothing more.

Every drafter implements `specdec.drafter.Drafter`: a draft model (`ModelDrafter`), n-gram
prompt lookup (`NgramDrafter`), suffix decoding (`SuffixDrafter`), the hybrid, chain drafters tried
in order (`HybridDrafter`, `A+B`), the composite, several chosen per step (`CompositeDrafter`,
`A|B`), Medusa heads (`MedusaDrafter`) and EAGLE-3 heads (`EagleDrafter`). A string names one in
the method grammar (`specdec.methods`); `specdec.loader.make_drafter` builds it. What times and
chooses (draft length, tree sizes, block costs, gates) lives in `specdec.tuning`.
"""

from __future__ import annotations

from specdec.drafter import Drafter
from specdec.drafters.composite import CompositeDrafter
from specdec.drafters.eagle.drafter import EagleDrafter, EagleTreeConfig
from specdec.drafters.hybrid import HybridDrafter
from specdec.drafters.medusa.drafter import MedusaDrafter
from specdec.drafters.model import DraftModel, ModelDrafter, VocabularyMismatchError, check_vocabularies
from specdec.drafters.ngram import NgramDrafter
from specdec.drafters.suffix import SuffixCache, SuffixConfig, SuffixDrafter

__all__ = ["CompositeDrafter", "DraftModel", "Drafter", "EagleDrafter", "EagleTreeConfig", "HybridDrafter",
           "MedusaDrafter", "ModelDrafter", "NgramDrafter", "SuffixCache", "SuffixConfig", "SuffixDrafter",
           "VocabularyMismatchError", "check_vocabularies"]
