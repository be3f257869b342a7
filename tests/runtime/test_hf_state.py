"""dense_hf_state: the runtime's weights under Hugging Face names equal the transformers model's."""

import pytest
import torch

from runtime.hf_state import dense_hf_state, is_tied
from runtime.tiny import tiny_pair


@pytest.mark.parametrize("model_type, tied", [("llama", True), ("qwen2", False)])
def test_dense_hf_state_equals_the_transformers_state(model_type, tied):
    model, hf = tiny_pair(model_type, seed=3, tie_word_embeddings=tied)
    state = dense_hf_state(model)
    expected = {k: v for k, v in hf.state_dict().items() if not (tied and k == "lm_head.weight")}
    assert is_tied(model) == tied
    assert set(state) == set(expected)
    for key, t in expected.items():
        assert torch.equal(state[key], t), key


def test_skipped_linears_keep_their_biases():
    model, _ = tiny_pair("qwen2", seed=3)
    state = dense_hf_state(model, torch.bfloat16, skip={"layers.0.attn.wqkv", "layers.1.mlp.w13"})
    assert "model.layers.0.self_attn.q_proj.weight" not in state
    assert "model.layers.0.self_attn.q_proj.bias" in state
    assert "model.layers.1.mlp.gate_proj.weight" not in state and "model.layers.1.mlp.up_proj.weight" not in state
    assert state["model.layers.1.self_attn.q_proj.weight"].dtype == torch.bfloat16
