"""specdec: speculative decoding on the runtime engine. `generate`, drafters, verification, stats."""

from specdec.drafter import Accepted, Drafter, DraftTree
from specdec.generate import GenerateOutput, generate
from specdec.stats import AcceptanceStats

__all__ = ["generate", "GenerateOutput", "AcceptanceStats", "Drafter", "DraftTree", "Accepted"]
