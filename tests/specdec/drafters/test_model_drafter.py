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


def test_a_row_stops_drafting_below_p_min_and_the_step_when_every_row_has(target, random_draft):
    rows = [torch.randint(0, 8, (n,), generator=torch.Generator().manual_seed(n)) for n in (4, 7)]
    free = ModelDrafter(random_draft, target)
    free.begin(rows, 64, None)
    full = free.propose(rows, 6, [0, 1])
    assert full.lens.tolist() == [6, 6] and full.scores is not None
    assert bool((full.scores[:, 1:] <= full.scores[:, :-1]).all())  # a product of probabilities along the chain
    step = full.scores[:, 0].tolist()  # the first draft's probability per row
    p_min = (min(step) + max(step)) / 2 if min(step) < max(step) else max(step) + 1e-6
    bounded = ModelDrafter(random_draft, target, p_min=p_min)
    bounded.begin(rows, 64, None)
    tree = bounded.propose(rows, 6, [0, 1])
    for b in range(2):
        probs = torch.cat([tree.scores[b, :1], tree.scores[b, 1:] / tree.scores[b, :-1]])  # each draft's own
        stop = next((i for i, p in enumerate(probs.tolist()) if p < p_min), 6)
        assert int(tree.lens[b]) == stop
        assert torch.equal(tree.tokens[b, :stop], full.tokens[b, :stop])
    with pytest.raises(ValueError, match="p_min"):
        ModelDrafter(random_draft, target, p_min=1.0)


@pytest.mark.parametrize("k", [4, "auto"])
def test_greedy_output_with_p_min_equals_plain(target, random_draft, k):
    import specdec

    rows = [torch.randint(0, 8, (n,), generator=torch.Generator().manual_seed(n)).repeat(2) for n in (3, 9)]
    plain = specdec.generate(target, rows, max_new_tokens=20).sequences
    out = specdec.generate(target, rows, draft=ModelDrafter(target, target, p_min=0.3), max_new_tokens=20,
                           num_draft_tokens=k)
    assert all(torch.equal(a, b) for a, b in zip(out.sequences, plain))
