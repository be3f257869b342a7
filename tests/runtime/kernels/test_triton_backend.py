"""A runtime.Transformer with attention="triton" matches attention="sdpa" (interpreter on the CPU,
the compiled kernels on a CUDA GPU: both models and every input on DEVICE).

Tiny random Qwen2 (head dim 64, GQA 2:1, qkv bias) over the static cache, float32: a prefill,
a rollback that makes the rows ragged, greedy decode steps, and one tree-verification block.
Same greedy tokens, logits within 2e-4 (float32 attention differs only in summation order).
"""

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from runtime.attention import attend
from runtime.kernels.flash_attention import visible_mask
from runtime.loading import from_hf_state

LOGITS_ATOL = 2e-4
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def models():
    cfg = Qwen2Config(vocab_size=128, hidden_size=128, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    torch.manual_seed(0)  # transformers initialises weights from the global generator
    state = AutoModelForCausalLM.from_config(cfg).state_dict()
    return {name: from_hf_state(state, cfg, device=DEVICE, attention=name).eval() for name in ("sdpa", "triton")}


def run(model, prompt, steps):
    """Prefill, ragged rollback, greedy decode, then a tree block: (tokens (B, steps), logits list)."""
    B, T = prompt.shape
    cache = model.new_cache(B, 64)
    logits = [model(prompt, torch.arange(T, device=DEVICE).expand(B, T), cache).logits]
    cache.rollback(torch.tensor([T, T - 5], device=DEVICE))  # row 1 forgets its last 5 tokens
    token = logits[0][:, -1:].argmax(-1)  # (B, 1)
    tokens = []
    for _ in range(steps):
        step = model(token, cache.lengths[:, None].clone(), cache).logits
        logits.append(step)
        token = step[:, -1:].argmax(-1)
        tokens.append(token)
    # a verification block: a root and two children, one with a child of its own
    bits = torch.tensor([0b0001, 0b0011, 0b0101, 0b1011], device=DEVICE).expand(B, 4)
    depth = torch.tensor([0, 1, 1, 2], device=DEVICE)
    prefix = cache.lengths.clone()
    mask = visible_mask(prefix, 4, int(prefix.max()) + 4, tree_bits=bits)  # (B, 4, S)
    block = torch.tensor([[5, 9, 17, 33]], device=DEVICE).expand(B, 4)
    logits.append(model(block, prefix[:, None] + depth, cache, mask=mask).logits)
    return torch.cat(tokens, dim=1), logits


@torch.inference_mode()
def test_triton_backend_model_matches_sdpa(models):
    prompt = torch.randint(0, 128, (2, 13), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    tok_sdpa, logits_sdpa = run(models["sdpa"], prompt, steps=6)
    tok_triton, logits_triton = run(models["triton"], prompt, steps=6)
    assert torch.equal(tok_sdpa, tok_triton)
    for a, b in zip(logits_sdpa, logits_triton):
        assert (a - b).abs().max().item() <= LOGITS_ATOL


def test_triton_backend_attend_reads_cache_views():
    # attend() with backend="triton" on a strided cache view equals backend="sdpa" (explicit mask and causal)
    g = torch.Generator().manual_seed(2)
    cache_k = torch.randn(2, 2, 40, 64, generator=g).to(DEVICE)  # (B, Hkv, S_max, D)
    cache_v = torch.randn(2, 2, 40, 64, generator=g).to(DEVICE)
    q = torch.randn(2, 6, 3, 64, generator=g).to(DEVICE)
    prefix = torch.tensor([20, 7], device=DEVICE)
    k, v = cache_k[:, :, :23], cache_v[:, :, :23]
    causal = visible_mask(prefix, 3, 23)
    for mask in (None, causal):
        out = attend(q, k, v, mask, prefix, backend="triton")
        ref = attend(q, k, v, causal, prefix, backend="sdpa")
        assert (out - ref).abs().max().item() <= 1e-5


@pytest.mark.parametrize("grad", [True, False])
def test_triton_backend_under_autocast_and_autograd(models, grad):
    """A float32 model with attention="triton" under bf16 autocast: RoPE leaves q, k in float32 and
    v in bf16 (the kernel needs one dtype), and a training forward needs a backward (the kernel has
    none): logits and, when trained, gradients match the SDPA model's."""
    tokens = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    positions = torch.arange(11, device=DEVICE).expand(2, 11)
    out = {}
    for name, model in models.items():
        weight = model.layers[0].attn.wqkv.weight
        before = weight.requires_grad
        weight.requires_grad_(grad)
        weight.grad = None
        with torch.set_grad_enabled(grad), torch.autocast(torch.device(DEVICE).type, dtype=torch.bfloat16):
            logits = model(tokens, positions, None).logits  # (B, T, V)
        if grad:
            logits.float().square().mean().backward()
        out[name] = logits.float().detach(), weight.grad
        weight.requires_grad_(before)
        weight.grad = None  # the models are shared with the other tests of this module
    scale = out["sdpa"][0].abs().max().item()
    assert (out["sdpa"][0] - out["triton"][0]).abs().max().item() <= 0.02 * scale  # bf16 products
    if grad:
        assert out["sdpa"][1] is not None and torch.equal(out["sdpa"][1], out["triton"][1])  # both through SDPA
