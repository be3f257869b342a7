"""Fixtures for distill tests: a tiny random Llama model (float32) and a real word-level tokenizer."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

from runtime.loading import from_hf_state

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> "
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")


@pytest.fixture(scope="session")
def tiny_model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return from_hf_state(AutoModelForCausalLM.from_config(cfg).state_dict(), cfg)


@pytest.fixture(scope="session")
def word_tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    words = ["<unk>", "<|im_start|>", "<|im_end|>", "user", "assistant"] + [f"w{i}" for i in range(123)]
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHAT_TEMPLATE
    return fast
