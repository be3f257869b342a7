"""N-gram prompt lookup proposes what followed the latest earlier match, as a chain."""

import torch

from specdec.drafters import NgramDrafter


def test_ngram_lookup_proposes_what_followed_the_latest_match():
    d = NgramDrafter(max_n=3, min_n=1)
    seq = torch.tensor([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3])
    assert d.lookup(seq, 3).tolist() == [7, 8, 5]
    assert d.lookup(torch.tensor([4, 5, 6]), 3).numel() == 0


def test_proposals_are_chains_for_the_asked_rows_only():
    d = NgramDrafter()
    seqs = [torch.tensor([1, 2, 3, 1, 2]), torch.tensor([1, 2, 3, 1, 2])]
    tree = d.propose(seqs, 2, [1])
    assert tree.is_chain and tree.lens.tolist() == [0, 2] and tree.tokens[1].tolist() == [3, 1]
