"""Shared fixtures for quant tests: a tiny byte-level tokenizer trained in memory and calibration windows."""

import pytest
import torch

TEXTS = [f"def function_{i}(x):\n    return x * {i} + {i * i}  # line {i}\n" for i in range(200)]


@pytest.fixture(scope="session")
def tokenizer():
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(TEXTS, vocab_size=300, min_frequency=1, special_tokens=["<eos>"], show_progress=False)
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<eos>")


@pytest.fixture(scope="session")
def calib():
    g = torch.Generator().manual_seed(123)
    return torch.randint(0, 128, (8, 32), generator=g)  # (N, T)


@pytest.fixture(scope="session")
def eval_windows():
    g = torch.Generator().manual_seed(456)
    return torch.randint(0, 128, (4, 32), generator=g)  # (N, T)


def sqnr_db(ref: torch.Tensor, got: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB."""
    ref, got = ref.double(), got.double()
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - got).pow(2).sum().clamp(min=1e-30)))
