"""The shared base of the two combinators, `HybridDrafter` (A+B) and `CompositeDrafter` (A|B): every
row event goes to each member drafter."""

from __future__ import annotations

import torch

from specdec.drafter import Accepted, Drafter


class MemberDrafters(Drafter):
    """Forwards begin / reserve / cache_prefixes / admit / release / commit to every drafter in `self.drafters`; a
    subclass decides how their proposals combine (`propose`)."""

    drafters: list[Drafter]

    def begin(self, prompts: list[torch.Tensor], max_len: int, hidden: torch.Tensor | None) -> None:
        for d in self.drafters:
            d.begin(prompts, max_len, hidden)

    def reserve(self, batch_size: int, max_len: int) -> None:
        for d in self.drafters:
            d.reserve(batch_size, max_len)

    def admit(self, row: int, prompt: torch.Tensor, hidden: torch.Tensor | None) -> None:
        for d in self.drafters:
            d.admit(row, prompt, hidden)

    def cache_prefixes(self, tokens: int) -> None:
        for d in self.drafters:
            d.cache_prefixes(tokens)

    def release(self, row: int) -> None:
        for d in self.drafters:
            d.release(row)

    def commit(self, accepted: Accepted) -> None:
        for d in self.drafters:
            d.commit(accepted)
