"""Speculation on four-bit targets: every drafter stays lossless at temperature 0 (float32) and
sampling keeps the target's law when the target (and the draft) run BlockQuantLinear weights,
eager and compiled; a checkpoint quantized by `quant` moves to the same kernels."""

import pytest
import torch

import quant
import specdec
from runtime.blockq import BlockQuantLinear, to_block_quant
from runtime.kernels import cpu_blockq
from runtime.tiny import tiny_model
from specdec.drafters.eagle.drafter import EagleDrafter, EagleTreeConfig
from specdec.drafters.eagle.head import Eagle3Config, Eagle3Head
from specdec.drafters.medusa.heads import MedusaConfig, MedusaHeads
from tests.specdec.conftest import V
from tests.specdec.test_decode import assert_two_token_law

pytestmark = pytest.mark.skipif(not cpu_blockq.available(), reason="block-quantized CPU kernels not built here")


def four_bit(model):
    """`model` quantized by quant's RTN INT4 (groups of 32, the LM head too), then moved to the
    block kernels: what `load_model` does with such a checkpoint."""
    quant.quantize_(model, quant.Int4WeightOnly(group_size=32, include_lm_head=True), progress=False)
    assert to_block_quant(model) > 0
    return model


@pytest.fixture(scope="module")
def target():
    return four_bit(tiny_model("llama", seed=0, vocab_size=V, num_hidden_layers=4))


@pytest.fixture(scope="module")
def draft():
    return four_bit(tiny_model("qwen2", seed=7, vocab_size=V, num_hidden_layers=1))


def _rows(seed=0, lengths=(3, 12, 6)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 8, (n,), generator=g).repeat(2) for n in lengths]  # repeats: n-grams match


def _medusa(model):
    heads = MedusaHeads(MedusaConfig(model.config.hidden_size, V, num_heads=3), model.lm_head)
    g = torch.Generator().manual_seed(0)
    for blk in heads.blocks:
        blk[0].linear.weight.data = torch.randn(64, 64, generator=g) * 0.3
    return heads


def _eagle(model):
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config.from_target(model, draft_vocab_size=32))
    head.set_draft_vocab(torch.arange(32) * 2)
    return EagleDrafter(head, model, EagleTreeConfig(depth=3, top_k=4, total_tokens=12))


def test_the_models_run_block_kernels(target, draft):
    for model in (target, draft):
        assert isinstance(model.layers[0].mlp.w13, BlockQuantLinear)
        assert isinstance(model.lm_head, BlockQuantLinear)


@pytest.mark.parametrize("which", ["self", "draft", "ngram", "hybrid", "medusa", "eagle"])
def test_greedy_speculation_equals_plain_decoding(target, draft, which):
    rows = _rows(seed=1)
    plain = specdec.generate(target, rows, max_new_tokens=24).sequences
    drafter = {"self": target, "draft": draft, "ngram": "ngram", "hybrid": ["ngram", draft],
               "medusa": _medusa(target), "eagle": _eagle(target)}[which]
    for k in ([3, "auto"] if which in ("self", "draft", "ngram", "hybrid") else [5]):
        out = specdec.generate(target, rows, draft=drafter, max_new_tokens=24, num_draft_tokens=k)
        assert all(torch.equal(a, b) for a, b in zip(out.sequences, plain)), (which, k)
    if which == "self":
        assert out.stats.acceptance_rate == 1.0  # the same 4-bit arithmetic on both sides


def test_speculative_sampling_keeps_the_joint_law_of_two_tokens(target, draft):
    n = 6000
    prompt = torch.tensor([1, 2, 3, 4])
    kw = dict(temperature=0.8, top_k=12, top_p=0.9)
    out = specdec.generate(target, [prompt] * n, draft=draft, max_new_tokens=3, num_draft_tokens=2,
                           generator=torch.Generator().manual_seed(1), **kw)
    assert out.stats.drafted_tokens >= n
    assert_two_token_law(target, prompt, out.sequences, kw)


def test_compiled_four_bit_target_equals_eager():
    model = four_bit(tiny_model("llama", seed=3, vocab_size=V))
    rows = _rows(seed=2)
    eager = specdec.generate(model, rows, max_new_tokens=12).sequences
    eager_ngram = specdec.generate(model, rows, draft="ngram", max_new_tokens=12, num_draft_tokens=3).sequences
    model.compile_decode()
    compiled = specdec.generate(model, rows, draft="ngram", max_new_tokens=12, num_draft_tokens=3).sequences
    assert all(torch.equal(a, b) for a, b in zip(compiled, eager))
    assert all(torch.equal(a, b) for a, b in zip(eager_ngram, eager))
