"""The hybrid: chain drafters tried in order per step (`A+B` in the method grammar; generate()'s
`draft=["ngram", draft_model]`)."""

from __future__ import annotations

import torch

from specdec.drafter import Drafter, DraftTree
from specdec.drafters.members import MemberDrafters


class HybridDrafter(MemberDrafters):
    """Chain drafters tried in order per step: each row takes the first non-empty proposal
    (n-gram lookup first, so the draft model runs only for rows where the lookup finds nothing)."""

    def __init__(self, drafters: list[Drafter]) -> None:
        if not drafters:
            raise ValueError("an empty list of drafters; pass at least one")
        trees = [d.name for d in drafters if not d.adaptive or d.needs_hidden]
        if trees:
            raise ValueError(f"a list of drafters combines chain drafters (draft models, 'ngram'); "
                             f"{', '.join(trees)} drafts trees from the target's hidden states: pass it alone")
        self.drafters = drafters
        self.name = "+".join(d.name for d in drafters)
        self.runs_model = any(d.runs_model for d in drafters)
        self.owners: dict[int, str] = {}  # row -> the member whose proposal it took last step

    def draft_cost(self, k: int) -> float:
        return max(d.draft_cost(k) for d in self.drafters)

    def propose(self, seqs: list[torch.Tensor], k: int, rows: list[int]) -> DraftTree:
        B = len(seqs)
        tokens = torch.zeros(B, k, dtype=torch.long)  # (B, k)
        lens = torch.zeros(B, dtype=torch.long)  # (B,)
        owner: dict[int, DraftTree] = {}
        self.owners = {}
        todo = list(rows)
        for d in self.drafters:
            if not todo:
                break
            tree = d.propose(seqs, k, todo)
            if not tree.is_chain:
                raise ValueError(f"{d.name} proposed a tree; a list of drafters combines chains only")
            for b in todo:
                n = int(tree.lens[b])
                if n > 0:
                    tokens[b, :n], lens[b], owner[b] = tree.tokens[b, :n], n, tree
                    self.owners[b] = d.name
            todo = [b for b in todo if b not in owner]
        sampled = [t.q for t in owner.values() if t.q is not None]
        if not sampled:
            return DraftTree.chain(tokens, lens)
        q = torch.nn.functional.one_hot(tokens, sampled[0].shape[-1]).float()  # (B, k, V): one-hot rows stay
        for b, tree in owner.items():
            if tree.q is not None:
                q[b, :tree.q.shape[1]] = tree.q[b]
        return DraftTree.chain(tokens, lens, q)

    def source(self, row: int) -> str:
        return self.owners.get(row, self.name)


def from_spec(spec, target, loader) -> list:
    """`A+B` or `hybrid:NAME_OR_PATH` (= ngram+draft:NAME_OR_PATH; specdec.methods): its
    members' draft arguments, tried in order."""
    return [part.load(target, loader) for part in spec.parts]
