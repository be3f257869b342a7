"""Tiny random models from a config: for tests, examples and quick experiments (no download)."""

from __future__ import annotations

import torch

from runtime.loading import from_hf_state
from runtime.model import Transformer

_CONFIGS = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "mistral": "MistralConfig"}


def tiny_hf_config(model_type: str = "llama", **overrides):
    """A small transformers config of the given family (defaults: 2 layers, width 64, vocab 128)."""
    import transformers  # transformers: heavy, only for the tests' tiny models

    if model_type not in _CONFIGS:
        raise ValueError(f"model_type must be one of {', '.join(_CONFIGS)}, got {model_type!r}")
    args = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    args.update(overrides)
    return getattr(transformers, _CONFIGS[model_type])(**args)


def tiny_pair(model_type: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """(runtime Transformer, transformers model) with identical random weights."""
    from transformers import AutoModelForCausalLM  # transformers: heavy, only for the tests' tiny models

    cfg = tiny_hf_config(model_type, **overrides)
    with torch.random.fork_rng():  # transformers initialises from the global RNG; keep it untouched
        torch.manual_seed(seed)
        hf = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    return from_hf_state(hf.state_dict(), cfg, dtype=dtype), hf


def tiny_model(model_type: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float32,
               **overrides) -> Transformer:
    """A runtime Transformer with random weights drawn under `seed`."""
    return tiny_pair(model_type, seed, dtype, **overrides)[0]
