"""The runtime Transformer against transformers: logits, masks, ragged rows, hidden states."""

import pytest
import torch

from runtime.errors import UnsupportedModelError
from runtime.config import ModelConfig
from runtime.tiny import tiny_hf_config, tiny_pair


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("family,extra", [("llama", {}), ("qwen2", {}), ("mistral", {"sliding_window": 16}),
                                          ("llama", {"tie_word_embeddings": True}),
                                          ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0,
                                                                         "factor": 8.0, "low_freq_factor": 1.0,
                                                                         "high_freq_factor": 4.0,
                                                                         "original_max_position_embeddings": 64}})])
def test_logits_match_transformers_prefill_and_32_decode_steps(family, extra):
    model, hf = tiny_pair(family, seed=1, **extra)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (2, 40), generator=g)
    with torch.no_grad():
        ref = hf(ids).logits  # (2, 40, V)
        cache = model.new_cache(2, 64)
        pos = torch.arange(40)[None].expand(2, -1)
        steps = [model(ids[:, :8], pos[:, :8], cache)]
        for t in range(8, 40):
            steps.append(model(ids[:, t:t + 1], pos[:, t:t + 1], cache))
    got = torch.cat(steps, 1)
    assert _rel(got, ref) <= 1e-4


def test_ragged_rows_in_one_pass_equal_rows_alone():
    model, _ = tiny_pair("qwen2", seed=2)
    g = torch.Generator().manual_seed(1)
    a, b = torch.randint(0, 128, (5,), generator=g), torch.randint(0, 128, (9,), generator=g)
    with torch.no_grad():
        cache = model.new_cache(2, 16)
        tokens = torch.zeros(2, 9, dtype=torch.long)
        tokens[0, :5], tokens[1] = a, b
        model(tokens, torch.arange(9)[None].expand(2, -1), cache)
        cache.rollback(torch.tensor([5, 9]))
        nxt = torch.tensor([[3], [4]])
        both = model(nxt, cache.lengths[:, None].clone(), cache)
        for row, (prompt, tok) in enumerate([(a, 3), (b, 4)]):
            c1 = model.new_cache(1, 16)
            model(prompt[None], torch.arange(prompt.numel())[None], c1)
            alone = model(torch.tensor([[tok]]), torch.tensor([[prompt.numel()]]), c1)
            assert torch.allclose(both[row], alone[0], atol=1e-5)


def test_tree_mask_scores_each_branch_as_its_own_chain():
    model, _ = tiny_pair("llama", seed=3)
    prompt = torch.arange(1, 7)[None]
    with torch.no_grad():
        cache = model.new_cache(1, 32)
        model(prompt, torch.arange(6)[None], cache)
        # tree: node0 (root child), node1 and node2 both children of node0
        nodes = torch.tensor([[10, 11, 12]])
        mask = torch.ones(1, 3, 9, dtype=torch.bool)
        mask[0, :, 6:] = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
        tree = model(nodes, torch.tensor([[6, 7, 7]]), cache, mask=mask)
        for leaf, col in ((11, 1), (12, 2)):
            c = model.new_cache(1, 32)
            chain = model(torch.cat([prompt, torch.tensor([[10, leaf]])], 1), torch.arange(8)[None], c)
            assert torch.allclose(tree[0, col], chain[0, -1], atol=1e-5)


def test_return_hidden_and_logits_idx():
    model, hf = tiny_pair("llama", seed=4)
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits, hidden = model(ids, torch.arange(7)[None].expand(2, -1), None, return_hidden=True)
        ref = hf(ids, output_hidden_states=True)
        picked = model(ids, torch.arange(7)[None].expand(2, -1), None, logits_idx=torch.tensor([[6], [2]]))
    assert hidden.shape == (2, 7, 64)
    assert _rel(hidden, ref.hidden_states[-1]) <= 1e-5
    assert torch.allclose(picked[0, 0], logits[0, 6], atol=1e-6)
    assert torch.allclose(picked[1, 0], logits[1, 2], atol=1e-6)


def test_unsupported_model_type_names_it_and_points_to_the_adapter():
    from transformers import GPT2Config

    with pytest.raises(UnsupportedModelError, match="gpt2.*HFAdapter"):
        ModelConfig.from_hf(GPT2Config())


def test_config_validates_gqa():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ModelConfig.from_hf(tiny_hf_config("llama", num_attention_heads=4, num_key_value_heads=3))
