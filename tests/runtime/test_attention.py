"""runtime.attention: grouped-query attention folded into the query axis; causal and block masks."""

import pytest
import torch
import torch.nn.functional as F

from runtime.attention import block_mask_keys, causal_mask, sdpa_gqa


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,Hq,Hkv,T,S", [(2, 12, 2, 1, 9), (3, 6, 3, 5, 17), (1, 4, 4, 7, 7), (1, 12, 2, 24, 40)])
def test_sdpa_gqa_matches_pytorch_enable_gqa(dtype, B, Hq, Hkv, T, S):
    g = torch.Generator().manual_seed(0)
    # q as the model makes it: a transposed (B, T, Hq, D) projection, not contiguous in (B, Hq, T, D)
    q = torch.randn(B, T, Hq, 16, generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(B, Hkv, S, 16, generator=g).to(dtype)
    v = torch.randn(B, Hkv, S, 16, generator=g).to(dtype)
    mask = torch.rand(B, T, S, generator=g) < 0.6
    mask[..., 0] = True  # every query sees at least one key
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=Hq != Hkv)
    torch.testing.assert_close(sdpa_gqa(q, k, v, mask), ref, atol=1e-6, rtol=1e-5)
    ref_all = F.scaled_dot_product_attention(q, k, v, enable_gqa=Hq != Hkv)
    torch.testing.assert_close(sdpa_gqa(q, k, v, None), ref_all, atol=1e-6, rtol=1e-5)
    # query head h reads KV head h // (Hq / Hkv): changing KV head 0 leaves the other groups alone
    k2 = k.clone()
    k2[:, 0] += 1
    changed = (sdpa_gqa(q, k2, v, mask) - sdpa_gqa(q, k, v, mask)).abs().amax(dim=(0, 2, 3)) > 0  # (Hq,)
    assert changed.tolist() == [h < Hq // Hkv for h in range(Hq)]


@pytest.mark.parametrize("window", [None, 3])
def test_a_lower_triangular_block_mask_is_the_causal_mask(window):
    """block_mask_keys with a causal block over the new tokens equals causal_mask, sliding window
    included, on ragged rows."""
    prefix = torch.tensor([2, 5, 0])
    T, S = 4, 9
    block = torch.ones(T, T, dtype=torch.bool).tril().expand(3, T, T)
    positions = prefix[:, None] + torch.arange(T)  # (B, T)
    got = block_mask_keys(prefix, block, S, positions, window)
    assert torch.equal(got, causal_mask(prefix, T, S, window))
