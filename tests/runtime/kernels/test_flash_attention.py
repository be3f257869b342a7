"""runtime.kernels.flash_attention against its float64 reference (Triton interpreter on the CPU,
the compiled kernels on a CUDA GPU: every input is made on DEVICE).

Error bound, max |out - ref| on N(0, 1) inputs: 2 * u * max|v| + 1e-5, u the unit roundoff of
the input dtype (2^-24 float32, 2^-11 float16, 2^-8 bfloat16). P is rounded to the input dtype
before the P V product and the output is rounded once, each costing at most u * max|v|; the
float32 accumulation adds ~1e-6. Every K/V is a strided view of a larger cache whose garbage
slots (past prefix_lens[b] + T) hold NaN, so reading one would fail the test.
"""

import os

import pytest
import torch

from runtime.kernels.flash_attention import (
    FlashConfig,
    flash_attention,
    flash_attention_ref,
    interpreted,
    visible_mask,
)
from runtime.kernels.flash_decoding import choose_num_splits

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def error_bound(v: torch.Tensor) -> float:
    return 2 * UNIT_ROUNDOFF[v.dtype] * v.float().nan_to_num(0.0).abs().max().item() + 1e-5


def make_inputs(B, Hq, Hkv, T, D, prefix, dtype, seed=0, s_max=None):
    """q (B, Hq, T, D) and K/V views (B, Hkv, S, D) of a (B, Hkv, S_max, D) cache, NaN past each row."""
    g = torch.Generator().manual_seed(seed)
    prefix_lens = torch.tensor(prefix, dtype=torch.long)
    S = int(prefix_lens.max()) + T
    s_max = s_max or S + 7
    q = torch.randn(B, T, Hq, D, generator=g).to(dtype).transpose(1, 2)  # as the model makes it
    k_cache = torch.randn(B, Hkv, s_max, D, generator=g).to(dtype)
    v_cache = torch.randn(B, Hkv, s_max, D, generator=g).to(dtype)
    for b in range(B):
        k_cache[b, :, prefix[b] + T:] = float("nan")
        v_cache[b, :, prefix[b] + T:] = float("nan")
    q, k_cache, v_cache = q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE)
    return q, k_cache[:, :, :S], v_cache[:, :, :S], prefix_lens.to(DEVICE)


def random_tree(T, g):
    """Parent links of a random tree over T new tokens (token 0 the root) -> ancestor-or-self bits (T,)."""
    bits = []
    for j in range(T):
        parent = int(torch.randint(0, j, (1,), generator=g)) if j else -1
        bits.append((bits[parent] if parent >= 0 else 0) | (1 << j))
    return torch.tensor(bits, dtype=torch.long, device=DEVICE)


def check(out, ref, v):
    assert out.shape == ref.shape and out.dtype == v.dtype
    err = (out.double() - ref).abs().max().item()
    assert err <= error_bound(v), f"max error {err:.3g} > bound {error_bound(v):.3g} for {v.dtype}"


def test_flash_kernels_are_interpreted_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU runs the compiled kernels")
    assert os.environ.get("TRITON_INTERPRET") == "1"
    assert interpreted(), "runtime.kernels was imported before TRITON_INTERPRET=1 was set"


@pytest.mark.parametrize("dtype,D,Hq,Hkv", [
    (torch.float32, 64, 2, 2),    # GQA ratio 1
    (torch.float16, 128, 6, 2),   # ratio 3
    (torch.bfloat16, 64, 7, 1),   # ratio 7
    (torch.float32, 128, 14, 2),  # ratio 7, two kv heads
])
def test_flash_causal_ragged_rows(dtype, D, Hq, Hkv):
    # three rows with different cached prefixes; S = 45 is no multiple of the 16-slot tiles
    q, k, v, prefix = make_inputs(3, Hq, Hkv, 4, D, [41, 9, 0], dtype)
    out = flash_attention(q, k, v, prefix_lens=prefix)
    check(out, flash_attention_ref(q, k, v, prefix_lens=prefix), v)


def test_flash_causal_prefill_spans_many_tiles():
    q, k, v, prefix = make_inputs(2, 6, 2, 37, 64, [0, 3], torch.float16, seed=1)
    out = flash_attention(q, k, v, prefix_lens=prefix)
    check(out, flash_attention_ref(q, k, v, prefix_lens=prefix), v)


def test_flash_sliding_window():
    q, k, v, prefix = make_inputs(2, 4, 2, 6, 64, [50, 21], torch.float32, seed=2)
    out = flash_attention(q, k, v, prefix_lens=prefix, window=19)
    ref = flash_attention_ref(q, k, v, prefix_lens=prefix, window=19)
    check(out, ref, v)
    full = flash_attention_ref(q, k, v, prefix_lens=prefix)
    assert (ref - full).abs().max() > 1e-2  # the window changes the answer


@pytest.mark.parametrize("dtype,D,Hq,Hkv", [(torch.float32, 64, 3, 1), (torch.float16, 128, 4, 4)])
def test_flash_tree_mask_and_tree_bits(dtype, D, Hq, Hkv):
    g = torch.Generator().manual_seed(3)
    T = 9
    q, k, v, prefix = make_inputs(2, Hq, Hkv, T, D, [30, 12], dtype, seed=3)
    bits = torch.stack([random_tree(T, g), random_tree(T, g)])  # (B, T)
    mask = visible_mask(prefix, T, k.shape[2], tree_bits=bits)  # (B, T, S)
    ref = flash_attention_ref(q, k, v, mask=mask, prefix_lens=prefix)
    out_mask = flash_attention(q, k, v, mask=mask, prefix_lens=prefix)
    out_bits = flash_attention(q, k, v, tree_bits=bits, prefix_lens=prefix)
    check(out_mask, ref, v)
    check(out_bits, ref, v)
    causal = flash_attention_ref(q, k, v, prefix_lens=prefix)
    assert (ref - causal).abs().max() > 1e-2  # the tree is not the chain
    chain = (2 ** (torch.arange(T, device=DEVICE) + 1) - 1).expand(2, T).contiguous()  # token t's ancestors: 0..t
    check(flash_attention(q, k, v, tree_bits=chain, prefix_lens=prefix), causal, v)


def test_flash_explicit_mask_arbitrary_pattern_and_empty_row():
    q, k, v, prefix = make_inputs(2, 4, 2, 5, 64, [20, 33], torch.float32, seed=4)
    g = torch.Generator().manual_seed(4)
    mask = (torch.rand(2, 5, k.shape[2], generator=g) > 0.6).to(DEVICE)
    mask[1, 2] = False  # a query that sees nothing gets zeros
    out = flash_attention(q, k, v, mask=mask, prefix_lens=prefix)
    check(out, flash_attention_ref(q, k, v, mask=mask, prefix_lens=prefix), v)
    assert torch.equal(out[1, :, 2], torch.zeros_like(out[1, :, 2]))


@pytest.mark.parametrize("dtype,T,Hq,Hkv,splits", [
    (torch.float32, 1, 7, 1, 4),
    (torch.float16, 3, 6, 2, 3),
])
def test_flash_decoding_split_kv_merge(dtype, T, Hq, Hkv, splits):
    # rows of 90 and 17 cached slots: some chunks of the short row see no key at all
    q, k, v, prefix = make_inputs(2, Hq, Hkv, T, 64, [90, 17], dtype, seed=5)
    split = flash_attention(q, k, v, prefix_lens=prefix, num_splits=splits)
    whole = flash_attention(q, k, v, prefix_lens=prefix, num_splits=1)
    ref = flash_attention_ref(q, k, v, prefix_lens=prefix)
    check(split, ref, v)
    check(whole, ref, v)


def test_flash_decoding_split_with_tree_bits():
    g = torch.Generator().manual_seed(6)
    q, k, v, prefix = make_inputs(1, 3, 1, 5, 64, [70], torch.float32, seed=6)
    bits = random_tree(5, g)[None]
    out = flash_attention(q, k, v, prefix_lens=prefix, tree_bits=bits, num_splits=3)
    check(out, flash_attention_ref(q, k, v, prefix_lens=prefix, tree_bits=bits), v)


def test_flash_choose_num_splits():
    assert choose_num_splits(num_programs=2, num_keys=32768, block_n=64, num_sms=132) == 64
    assert choose_num_splits(num_programs=16, num_keys=32768, block_n=64, num_sms=132) == 17
    assert choose_num_splits(num_programs=2, num_keys=1500, block_n=64, num_sms=132) == 2
    assert choose_num_splits(num_programs=2, num_keys=300, block_n=64, num_sms=132) == 1
    assert choose_num_splits(num_programs=512, num_keys=32768, block_n=64, num_sms=132) == 1


def test_flash_rejects_bad_inputs():
    q, k, v, prefix = make_inputs(1, 4, 2, 3, 64, [5], torch.float32)
    with pytest.raises(AssertionError, match="multiple of kv heads"):
        flash_attention(q[:, :3], k, v, prefix_lens=prefix)
    with pytest.raises(AssertionError, match="mask must be bool"):
        flash_attention(q, k, v, mask=torch.ones(1, 3, 2, dtype=torch.bool, device=DEVICE), prefix_lens=prefix)
    with pytest.raises(AssertionError, match="at most 64"):
        flash_attention(q.new_zeros(1, 4, 65, 64), k, v, tree_bits=torch.zeros(1, 65, dtype=torch.long, device=DEVICE))
    with pytest.raises(AssertionError, match="head dim"):
        flash_attention(q[..., :48], k[..., :48], v[..., :48], prefix_lens=prefix)
    with pytest.raises(ValueError, match="power of two"):
        FlashConfig(24, 16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["prefill", "decode_split", "tree"])
def test_flash_gpu_bf16_real_sizes(kind):
    B, Hq, Hkv, D = 2, 12, 2, 128
    if kind == "prefill":
        q, k, v, prefix = make_inputs(B, Hq, Hkv, 1024, D, [0, 100], torch.bfloat16)
        args = {}
    elif kind == "decode_split":
        q, k, v, prefix = make_inputs(B, Hq, Hkv, 1, D, [8000, 3001], torch.bfloat16)
        args = {"num_splits": 16}
    else:
        g = torch.Generator().manual_seed(7)
        q, k, v, prefix = make_inputs(B, Hq, Hkv, 32, D, [4000, 1234], torch.bfloat16)
        args = {"tree_bits": torch.stack([random_tree(32, g), random_tree(32, g)])}
    out = flash_attention(q, k, v, prefix_lens=prefix, **args)
    ref = flash_attention_ref(q, k, v, prefix_lens=prefix, tree_bits=args.get("tree_bits"))
    check(out, ref, v)
