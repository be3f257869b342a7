"""The draft-model drafter: its cost model (catch-up forward plus one-token forwards) and its
cache rollback to what the target accepted."""

import pytest
import torch

from specdec.drafter import Accepted
from specdec.drafters import ModelDrafter


def test_model_drafter_cost_is_catch_up_plus_one_token_forwards(target, random_draft):
    drafter = ModelDrafter(random_draft, target)
    rows = [torch.randint(0, 8, (5,), generator=torch.Generator().manual_seed(0)).repeat(2)]
    drafter.begin(rows, 64, None)
    proposal = drafter.propose(rows, 4, [0])
    assert proposal.is_chain and proposal.lens.tolist() == [4]
    assert drafter.first_s == 0 and drafter.step_s > 0  # the prompt's prefill is no step's cost
    accepted = [torch.cat([rows[0], proposal.tokens[0, :2], torch.tensor([7])])]  # 2 drafts + correction
    drafter.commit(Accepted(accepted, [[0, 1]]))
    assert drafter.cache.lengths.tolist() == [rows[0].numel() + 2]  # rolled back past the rejected drafts
    drafter.propose(accepted, 4, [0])
    assert drafter.first_s > 0
    assert drafter.draft_cost(1) == drafter.first_s
    assert drafter.draft_cost(4) == pytest.approx(drafter.first_s + 3 * drafter.step_s)
