"""quant.perplexity: equals exp of transformers' token-mean loss; batching does not change it."""

import math

import pytest
import torch

import quant
from runtime.tiny import tiny_pair


def test_matches_transformers_loss(eval_windows):
    model, hf = tiny_pair("qwen2", seed=7)
    with torch.no_grad():
        losses = [hf(w[None], labels=w[None]).loss for w in eval_windows]
    expected = math.exp(float(torch.stack(losses).mean()))  # equal-length windows: token mean = window mean
    assert quant.perplexity(model, eval_windows) == pytest.approx(expected, rel=1e-5)
    assert quant.perplexity(model, eval_windows, batch_size=3) == pytest.approx(expected, rel=1e-5)


def test_bad_batches():
    model, _ = tiny_pair("llama", seed=0)
    with pytest.raises(ValueError, match="LongTensor"):
        quant.perplexity(model, torch.zeros(2, 8))
    with pytest.raises(ValueError, match="T >= 2"):
        quant.perplexity(model, torch.zeros(2, 1, dtype=torch.long))


def test_bad_arguments_name_what_is_wrong():
    model, _ = tiny_pair("llama", seed=0)
    windows = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(TypeError, match="batches must be a LongTensor"):
        quant.perplexity(model, [[1, 2, 3]])
    with pytest.raises(ValueError, match=r"B >= 1 and T >= 2, got torch.int64 \(0, 8\)"):
        quant.perplexity(model, torch.zeros(0, 8, dtype=torch.long))
    with pytest.raises(ValueError, match=r"outside the model's vocabulary \[0, 128\): 128"):
        quant.perplexity(model, windows + 128)
    with pytest.raises(ValueError, match=r"outside the model's vocabulary \[0, 128\): -1"):
        quant.perplexity(model, windows - 1)
    with pytest.raises(TypeError, match="batch_size must be an integer >= 1"):
        quant.perplexity(model, windows, batch_size="2")
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1, got 0"):
        quant.perplexity(model, windows, batch_size=0)
