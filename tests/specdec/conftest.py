"""Fixtures of the specdec tests: a tiny target and an unrelated tiny draft over one vocabulary."""

import pytest

from runtime.tiny import tiny_model

V = 64  # the vocabulary of `target` and `random_draft`


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", seed=0, vocab_size=V)


@pytest.fixture(scope="module")
def random_draft():
    return tiny_model("qwen2", seed=7, vocab_size=V, num_hidden_layers=1)
