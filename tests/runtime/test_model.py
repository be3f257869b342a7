"""The runtime Transformer against transformers: logits, masks, ragged rows, hidden states; its
one forward body through `forward`, `static_step` and `run_block`."""

import pytest
import torch

from runtime.config import ModelConfig
from runtime.errors import UnsupportedModelError
from runtime.hf_adapter import HFAdapter
from runtime.model_output import ModelOutput
from runtime.tiny import tiny_hf_config, tiny_model, tiny_pair


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
        steps = [model(ids[:, :8], pos[:, :8], cache).logits]
        for t in range(8, 40):
            steps.append(model(ids[:, t:t + 1], pos[:, t:t + 1], cache).logits)
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
        both = model(nxt, cache.lengths[:, None].clone(), cache).logits
        for row, (prompt, tok) in enumerate([(a, 3), (b, 4)]):
            c1 = model.new_cache(1, 16)
            model(prompt[None], torch.arange(prompt.numel())[None], c1)
            alone = model(torch.tensor([[tok]]), torch.tensor([[prompt.numel()]]), c1).logits
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
        tree = model(nodes, torch.tensor([[6, 7, 7]]), cache, mask=mask).logits
        for leaf, col in ((11, 1), (12, 2)):
            c = model.new_cache(1, 32)
            chain = model(torch.cat([prompt, torch.tensor([[10, leaf]])], 1), torch.arange(8)[None], c).logits
            assert torch.allclose(tree[0, col], chain[0, -1], atol=1e-5)


def test_return_hidden_and_logits_idx():
    model, hf = tiny_pair("llama", seed=4)
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits, hidden, _ = model(ids, torch.arange(7)[None].expand(2, -1), None, return_hidden=True)
        ref = hf(ids, output_hidden_states=True)
        picked = model(ids, torch.arange(7)[None].expand(2, -1), None, logits_idx=torch.tensor([[6], [2]])).logits
    assert hidden.shape == (2, 7, 64)
    assert _rel(hidden, ref.hidden_states[-1]) <= 1e-5
    assert torch.allclose(picked[0, 0], logits[0, 6], atol=1e-6)
    assert torch.allclose(picked[1, 0], logits[1, 2], atol=1e-6)


@pytest.mark.parametrize("family,extra", [("llama", {}), ("qwen2", {}), ("mistral", {"sliding_window": 5})])
def test_run_block_chained_over_every_layer_gives_the_forward_hidden_states(family, extra):
    model = tiny_model(family, seed=5, **extra)
    ids = torch.randint(0, 128, (3, 11), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(11)[None].expand(3, -1)
    with torch.no_grad():
        want = model(ids, pos, None, return_hidden=True).hidden
        x = model.embed(ids)  # (B, T, C)
        for i in range(model.config.num_layers):
            x = model.run_block(i, x, pos)
        assert x.shape == (3, 11, 64)
        assert torch.equal(model.norm(x), want)


def _tree_block() -> torch.Tensor:
    """(1, 4, 4) bool: node 0 under the root, nodes 1 and 2 under node 0, node 3 under node 1."""
    return torch.tensor([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]], dtype=torch.bool)


@pytest.mark.parametrize("family,extra", [("qwen2", {}), ("mistral", {"sliding_window": 32})])
def test_static_step_equals_forward_with_a_cache(family, extra):
    """static_step (here uncompiled) runs the same body as forward: same logits, hidden states and
    cache contents for a ragged prefill, a decode step, a chain and a tree (block mask) step."""
    model = tiny_model(family, seed=6, **extra)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 128, (2, 17), generator=g)
    caches = [model.new_cache(2, 32) for _ in range(2)]
    tree = _tree_block().expand(2, 4, 4)
    with torch.no_grad():
        for cache in caches:  # ragged rows: 9 and 6 tokens
            model(ids[:, :9], torch.arange(9)[None].expand(2, -1), cache)
            cache.rollback(torch.tensor([9, 6]))
        steps = [(ids[:, 9:10], 0, None), (ids[:, 10:13], torch.arange(3), None),
                 (ids[:, 13:], torch.tensor([0, 1, 1, 2]), tree)]
        for tokens, offsets, block in steps:
            pos = caches[0].lengths[:, None] + torch.as_tensor(offsets)  # (B, T)
            want = model(tokens, pos, caches[0], return_hidden=True, block_mask=block)
            static = caches[1]
            got = model.static_step(tokens, pos, static.k, static.v, static.lengths, block_mask=block)
            static.lengths += tokens.shape[1]
            assert torch.allclose(got.logits, want.logits, atol=1e-5)
            assert torch.allclose(got.hidden, want.hidden, atol=1e-5)
            assert torch.equal(static.lengths, caches[0].lengths)
            for b, n in enumerate(static.lengths.tolist()):
                assert torch.allclose(static.k[:, b, :, :n], caches[0].k[:, b, :, :n], atol=1e-6)


def test_unsupported_model_type_names_it_and_points_to_the_adapter():
    from transformers import GPT2Config

    with pytest.raises(UnsupportedModelError, match="gpt2.*HFAdapter"):
        ModelConfig.from_hf(GPT2Config())


def test_config_validates_gqa():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ModelConfig.from_hf(tiny_hf_config("llama", num_attention_heads=4, num_key_value_heads=3))


def test_forward_returns_one_model_output_whose_fields_follow_the_arguments():
    """Every forward returns a ModelOutput; hidden and aux are there when asked for, else None; asking
    for aux layers sets no state on the model (the next forward is as before)."""
    model = tiny_model("llama", seed=7, num_hidden_layers=3)
    ids = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(5))
    pos = torch.arange(6)[None].expand(2, -1)
    with torch.no_grad():
        plain = model(ids, pos, None)
        before = dict(vars(model))
        both = model(ids, pos, model.new_cache(2, 8), return_hidden=True, aux_layers=(2, 0))
        assert vars(model) == before  # same attributes, same objects
        again = model(ids, pos, None)
        only_aux = model(ids, pos, None, aux_layers=(1,))
    assert isinstance(plain, ModelOutput) and isinstance(both, ModelOutput)
    assert plain.hidden is None and plain.aux is None and again.aux is None
    assert torch.equal(again.logits, plain.logits)
    assert both.hidden.shape == (2, 6, 64) and both.aux.shape == (2, 6, 2 * 64)
    assert torch.allclose(both.logits, plain.logits, atol=1e-5)
    assert torch.allclose(both.aux[..., 64:], model.embed(ids))  # layer 0's input: the embedding
    assert only_aux.hidden is None and only_aux.aux.shape == (2, 6, 64)
    with pytest.raises(ValueError, match=r"aux_layers .*0\.\.2"):
        model(ids, pos, None, aux_layers=(3,))


def test_hf_adapter_returns_the_runtime_models_output():
    """HFAdapter meets the same interface: logits, final hidden states and aux layers' states of
    a transformers model equal the runtime's on the same weights, with a cache or without."""
    model, hf = tiny_pair("qwen2", seed=8)
    adapter = HFAdapter(hf)
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(6))
    pos = torch.arange(7)[None].expand(2, -1)
    with torch.no_grad():
        for cache in ((model.new_cache(2, 8), adapter.new_cache(2, 8)), (None, None)):
            want = model(ids, pos, cache[0], return_hidden=True, aux_layers=(1, 0))
            got = adapter(ids, pos, cache[1], return_hidden=True, aux_layers=(1, 0))
            for name in ModelOutput._fields:
                assert _rel(getattr(got, name), getattr(want, name)) <= 1e-5, name
        bare = adapter(ids, pos, None)
    assert isinstance(bare, ModelOutput) and bare.hidden is None and bare.aux is None


def test_hf_adapter_refuses_what_it_cannot_do_by_name():
    model, hf = tiny_pair("llama", seed=8)
    adapter = HFAdapter(hf)
    ids, pos = torch.zeros(1, 3, dtype=torch.long), torch.arange(3)[None]
    with pytest.raises(TypeError, match="HFCache.*KVCache"):
        adapter(ids, pos, model.new_cache(1, 8))
    with pytest.raises(ValueError, match=r"aux_layers .*0\.\.1"):
        adapter(ids, pos, None, aux_layers=(2,))


@pytest.mark.parametrize("args, exc, phrase", [((-1, 16), ValueError, "batch_size must be an integer >= 1, got -1"),
                                               ((1, 0), ValueError, "max_seq_len must be an integer >= 1, got 0"),
                                               ((1.5, 16), TypeError, "batch_size must be an integer >= 1")])
def test_new_cache_names_a_bad_size(args, exc, phrase):
    with pytest.raises(exc, match=phrase):
        tiny_model("llama").new_cache(*args)
