"""N-gram prompt lookup: propose what followed the latest earlier occurrence of a row's last n tokens."""

from __future__ import annotations

import torch

from specdec.drafter import Drafter, DraftTree


class NgramDrafter(Drafter):
    """Prompt lookup: find the last n tokens (n from max_n down to min_n) earlier in the row and
    propose what followed the most recent such occurrence. No model, no state; q is one-hot."""

    name = "ngram"

    def __init__(self, max_n: int = 3, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n

    def reserve(self, batch_size: int, max_len: int) -> None:
        """Nothing to keep: the lookup reads the committed sequences."""

    def admit(self, row: int, prompt: torch.Tensor, hidden: torch.Tensor | None) -> None:
        """Nothing to prefill."""

    def release(self, row: int) -> None:
        """Nothing to forget."""

    def lookup(self, seq: torch.Tensor, k: int) -> torch.Tensor:
        """Up to k tokens that followed the latest earlier occurrence of seq's last n-gram."""
        L = seq.numel()
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            tail = seq[L - n:]
            windows = seq[:L - 1].unfold(0, n, 1)  # (L - n, n): starts whose continuation exists
            hits = (windows == tail).all(-1).nonzero().flatten()
            if hits.numel():
                start = int(hits[-1]) + n
                return seq[start:start + k]
        return seq[:0]

    def propose(self, seqs: list[torch.Tensor], k: int, rows: list[int]) -> DraftTree:
        B = len(seqs)
        tokens = torch.zeros(B, k, dtype=torch.long)  # (B, k)
        lens = torch.zeros(B, dtype=torch.long)  # (B,)
        for b in rows:
            found = self.lookup(seqs[b], k)
            tokens[b, :found.numel()] = found
            lens[b] = found.numel()
        return DraftTree.chain(tokens, lens)


def from_spec(spec, target, loader):
    """`ngram[@K]` (specdec.methods): the lookup itself; K is the caller's draft length."""
    return "ngram"
