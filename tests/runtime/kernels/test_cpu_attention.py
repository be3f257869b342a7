"""The C++ cache attention of compiled CPU steps gives the Python op's numbers and cache writes."""

import pytest
import torch

from runtime.attention import cache_attention
from runtime.kernels import cpu_attention

pytestmark = pytest.mark.skipif(not cpu_attention.available(), reason="CPU extension not built here")


@pytest.mark.parametrize("invariant", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["decode", "verify", "ragged", "window", "tree", "mha"])
def test_same_numbers_and_writes_as_the_python_op(dtype, case, invariant):
    g = torch.Generator().manual_seed(0)
    B, Hq, Hkv, D, L, S_max = 2, 6, 2, 16, 3, 64
    if case == "mha":
        Hkv = Hq
    T = 1 if case == "decode" else 5
    lens = torch.tensor([20, 20]) if case in ("decode", "verify", "mha", "tree") else torch.tensor([9, 23])
    window = 12 if case == "window" else 0
    q = torch.randn(B, Hq, T, D, generator=g).to(dtype)
    k, v = (torch.randn(B, Hkv, T, D, generator=g).to(dtype) for _ in range(2))
    caches = [torch.randn(L, B, Hkv, S_max, D, generator=g).to(dtype) for _ in range(2)]
    block = None
    if case == "tree":
        block = torch.tril(torch.ones(T, T, dtype=torch.bool)).expand(B, T, T).clone()
        block[:, 3, 1:3] = False  # node 3 hangs off node 0
    ref_k, ref_v = (c.clone() for c in caches)
    ref = cache_attention(q, k, v, ref_k, ref_v, 1, lens, window, block, invariant)
    got_k, got_v = (c.clone() for c in caches)
    got = cpu_attention.cache_attention(q, k, v, got_k, got_v, 1, lens, window, block, invariant)
    assert torch.equal(got, ref)
    assert torch.equal(got_k, ref_k) and torch.equal(got_v, ref_v)
