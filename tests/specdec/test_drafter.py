"""DraftTree: chains, depths, the ancestor mask, paths, and the checks on its shape."""

import pytest
import torch

from specdec.drafter import Accepted, Drafter, DraftTree


def test_a_chain_is_a_tree_with_one_branch():
    tree = DraftTree.chain(torch.tensor([[5, 6, 7]]), torch.tensor([3]))
    assert tree.is_chain and tree.parents.tolist() == [[-1, 0, 1]]
    assert tree.depths().tolist() == [[1, 2, 3]]
    assert torch.equal(tree.block_mask()[0], torch.ones(4, 4, dtype=torch.bool).tril())


def test_depths_mask_and_paths_of_a_tree():
    # root -> 0, 1; 0 -> 2; 2 -> 3 (row 0); row 1: every node a child of the root
    tree = DraftTree(torch.arange(8).view(2, 4), torch.tensor([[-1, -1, 0, 2], [-1, -1, -1, -1]]),
                     torch.tensor([4, 4]))
    assert not tree.is_chain
    assert tree.depths().tolist() == [[1, 1, 2, 3], [1, 1, 1, 1]]
    mask = tree.block_mask()  # over [root, nodes]
    assert mask[0, 4].tolist() == [True, True, False, True, True]  # node 3 sees root, 0, 2, itself
    assert mask[1, 4].tolist() == [True, False, False, False, True]
    assert tree.path(0, 3) == [0, 2, 3] and tree.path(1, 2) == [2] and tree.path(0, -1) == []


def test_malformed_trees_are_refused():
    with pytest.raises(ValueError, match="precedes"):
        DraftTree(torch.zeros(1, 2, dtype=torch.long), torch.tensor([[-1, 1]]), torch.tensor([2]))
    with pytest.raises(ValueError, match="one shape"):
        DraftTree(torch.zeros(1, 2, dtype=torch.long), torch.tensor([[-1]]), torch.tensor([2]))
    with pytest.raises(ValueError, match="q must be"):
        DraftTree.chain(torch.zeros(1, 2, dtype=torch.long), torch.tensor([2]), torch.zeros(1, 3, 5))


def test_accepted_gives_the_hidden_state_behind_the_next_root():
    hidden = torch.arange(2 * 4 * 1, dtype=torch.float).view(2, 4, 1)  # (B, 1 + N, C)
    acc = Accepted([torch.tensor([1]), torch.tensor([2])], [[0, 2], []], hidden)
    assert acc.last_hidden()[:, 0].tolist() == [3.0, 4.0]  # row 0: node 2 (slot 3); row 1: the root


def test_a_drafter_needs_only_propose():
    class Echo(Drafter):
        def propose(self, seqs, k, rows):
            return DraftTree.chain(torch.stack([s[-k:] for s in seqs]), torch.full((len(seqs),), k))

    d = Echo()
    assert d.adaptive and not d.needs_hidden and d.typical is None and d.draft_cost(3) == 0.0
    assert d.propose([torch.tensor([1, 2, 3])], 2, [0]).tokens.tolist() == [[2, 3]]
