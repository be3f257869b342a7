"""Medusa heads as a drafter: the heads' top-k guesses arranged by their sparse tree.

Each step reads the target's hidden state behind the last emitted token, takes each head's
top-k guesses (head i guesses the token i + 1 places after the root) and lays them out as the
heads' candidate tree (`specdec.drafters.medusa.tree`): one target forward verifies every branch. Verification
is greedy at temperature 0; at temperature > 0 it is lossless unless the heads ask for typical
acceptance (`heads.acceptance = "typical"`).
"""

from __future__ import annotations

import torch

from specdec.drafter import Accepted, Drafter, DraftTree, TypicalAcceptance
from specdec.drafters.medusa.heads import ACCEPTANCE, MedusaHeads, default_tree
from specdec.drafters.medusa.tree import build_tree, draft_tree


class MedusaDrafter(Drafter):
    """Drafts the tree of `heads` from the target's last hidden state; k is ignored."""

    name = "medusa"
    adaptive = False
    needs_hidden = True

    def __init__(self, heads: MedusaHeads, target) -> None:
        cfg, hc = target.config, heads.config
        if (hc.hidden_size, hc.vocab_size) != (cfg.hidden_size, cfg.vocab_size):
            raise ValueError(f"Medusa heads for hidden size {hc.hidden_size} / vocabulary {hc.vocab_size} "
                             f"cannot draft for a model with {cfg.hidden_size} / {cfg.vocab_size}; load "
                             "heads trained for this model (distill.load_medusa checks this)")
        if heads.acceptance not in ACCEPTANCE:
            raise ValueError(f"heads.acceptance must be one of {ACCEPTANCE}, got {heads.acceptance!r}")
        self.heads, self.tree = heads, heads.tree
        self.typical = (TypicalAcceptance(heads.typical_epsilon, heads.typical_delta)
                        if heads.acceptance == "typical" else None)
        self.hidden: torch.Tensor | None = None  # (B, C): the state behind each row's last token
        self.hidden_dtype, self.hidden_device = target.dtype, target.device

    def max_nodes(self, k: int) -> int:
        return self.tree.num_nodes - 1

    def begin(self, prompts: list[torch.Tensor], max_len: int, hidden: torch.Tensor | None) -> None:
        self.hidden = hidden

    def reserve(self, batch_size: int, max_len: int) -> None:
        C = self.heads.config.hidden_size
        self.hidden = torch.zeros(batch_size, C, dtype=self.hidden_dtype, device=self.hidden_device)  # (B, C)

    def admit(self, row: int, prompt: torch.Tensor, hidden: torch.Tensor | None) -> None:
        self.hidden[row] = hidden

    def release(self, row: int) -> None:
        """Nothing to forget: a free row's state is overwritten by its next admit."""

    def propose(self, seqs: list[torch.Tensor], k: int, rows: list[int]) -> DraftTree:
        return draft_tree(self.tree, self.heads.guesses(self.hidden, self.tree.topk), rows)

    def commit(self, accepted: Accepted) -> None:
        self.hidden = accepted.last_hidden()


def from_spec(spec, target, loader):
    """`medusa:DIR[@N]` (specdec.methods): the heads in DIR; with @N their candidate tree is
    rebuilt with N nodes from the per-rank accuracy stored with them (else the shipped table)."""
    def load():
        heads = loader.medusa(spec.arg, target)
        if spec.size is not None:
            acc = heads.config.head_accuracy
            paths = build_tree([list(r) for r in acc], spec.size) if acc else default_tree(heads.config.num_heads,
                                                                                           spec.size)
            heads.set_tree(paths)
        return heads

    return loader.cached(("medusa", str(spec)), load)
