"""specdec.rows: a batch whose prompts share a prefix prefills it once, with the results of a
prefill of every prompt whole."""

import pytest
import torch

import specdec
from runtime.tiny import tiny_model
from specdec.rows import MIN_SHARED, prefill, prefill_sharing
from tests.specdec.conftest import V


def _batch(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(0, V, (30,), generator=g)
    return [torch.cat([system, torch.randint(0, V, (5,), generator=g)]),
            torch.randint(0, V, (12,), generator=g),
            torch.cat([system, torch.randint(0, V, (9,), generator=g)]),
            system.clone()]  # all of it shared but the last token, which is prefilled for its logits


def _counted(model, monkeypatch) -> list[int]:
    """Tokens each forward of `model` runs."""
    seen, forward = [], model.forward

    def counting(tokens, *args, **kwargs):
        seen.append(tokens.numel())
        return forward(tokens, *args, **kwargs)

    monkeypatch.setattr(model, "forward", counting)
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_shared_prefix_is_prefilled_once_with_the_results_of_whole_prefills(dtype, monkeypatch):
    model = tiny_model("llama", seed=0, vocab_size=V, dtype=dtype)
    rows = _batch()
    whole_cache, shared_cache = model.new_cache(4, 64), model.new_cache(4, 64)
    with torch.inference_mode():
        whole = prefill(model, rows, whole_cache, return_hidden=True)
        seen = _counted(model, monkeypatch)
        shared = prefill_sharing(model, rows, shared_cache, return_hidden=True)
    # rows 0 and 1 prefilled (padded in one forward, or each alone on a row-invariant model), then
    # only what rows 2 and 3 add to row 0's 30 tokens (row 3 keeps one token to prefill)
    assert seen[-2:] == [9, 1] and sum(seen[:-2]) in (35 + 12, 2 * 35)
    assert torch.equal(shared_cache.lengths, whole_cache.lengths)
    exact = dtype == torch.bfloat16 and model.row_invariant
    for b, r in enumerate(rows):
        n = r.numel()
        for got, want in ((shared_cache.k[:, b, :, :n], whole_cache.k[:, b, :, :n]),
                          (shared_cache.v[:, b, :, :n], whole_cache.v[:, b, :, :n]),
                          (shared.logits[b], whole.logits[b]), (shared.hidden[b], whole.hidden[b])):
            assert torch.equal(got, want) if exact else torch.allclose(got, want, atol=1e-4)


def test_prompts_sharing_less_than_a_block_are_prefilled_as_before(monkeypatch):
    model = tiny_model("llama", seed=0, vocab_size=V)
    common = torch.arange(MIN_SHARED - 1)
    rows = [torch.cat([common, torch.tensor([1, 2])]), torch.cat([common, torch.tensor([3])])]
    seen = _counted(model, monkeypatch)
    with torch.inference_mode():
        prefill_sharing(model, rows, model.new_cache(2, 32))
    assert seen == [2 * (MIN_SHARED + 1)]  # one padded forward of both rows


@pytest.mark.parametrize("draft", [None, "ngram"])
def test_generate_on_prompts_with_a_common_prefix_equals_each_alone(target, draft):
    rows = _batch(seed=3)
    out = specdec.generate(target, rows, draft=draft, max_new_tokens=10)
    for b, r in enumerate(rows):
        alone = specdec.generate(target, [r], draft=draft, max_new_tokens=10)
        assert out.sequences[b][:r.numel() + 10].tolist() == alone.sequences[0].tolist()


def test_finding_the_shared_prefixes_is_linear_in_the_batch(monkeypatch):
    """Thousands of samples of one prompt (the sampling-law tests): each row is compared with at most
    two earlier rows, not with every earlier one."""
    import specdec.rows

    calls, common = [], specdec.rows.common_prefix
    monkeypatch.setattr(specdec.rows, "common_prefix", lambda a, b: calls.append(1) or common(a, b))
    model = tiny_model("llama", seed=0, vocab_size=V)
    rows = [torch.arange(MIN_SHARED + 4)] * 300
    with torch.inference_mode():
        prefill_sharing(model, rows, model.new_cache(300, 32))
    assert len(calls) <= 2 * 300
