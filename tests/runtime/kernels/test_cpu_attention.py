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


def _paged_copy(caches: list[torch.Tensor], bs: int, g: torch.Generator) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The rows of contiguous buffers (L, B, H, S_max, D) as pools (L, NB, H, bs, D) of shuffled blocks
    (block 0 the null block, left zero) and the block table (B, S_max / bs) that finds them."""
    L, B, H, S_max, D = caches[0].shape
    W = S_max // bs
    ids = (torch.randperm(B * W, generator=g) + 1).view(B, W)  # (B, W)
    pools = []
    for c in caches:
        pool = torch.zeros(L, B * W + 1, H, bs, D, dtype=c.dtype)
        pool[:, ids.flatten()] = c.view(L, B, H, W, bs, D).transpose(2, 3).reshape(L, B * W, H, bs, D)
        pools.append(pool)
    return pools, ids


def _rows_of(pool: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The pool's blocks back as contiguous rows (L, B, H, S_max, D)."""
    L, _, H, bs, D = pool.shape
    B, W = ids.shape
    return pool[:, ids.flatten()].view(L, B, W, H, bs, D).transpose(2, 3).reshape(L, B, H, W * bs, D)


@pytest.mark.parametrize("impl", ["python", "cpp"])
@pytest.mark.parametrize("invariant", [False, True])
@pytest.mark.parametrize("case", ["decode", "ragged", "window", "tree"])
def test_a_paged_cache_gives_the_contiguous_numbers_and_writes(case, invariant, impl):
    """Through a block table of shuffled blocks of 8: the same output bits and the same slots written
    (the invariant kernel reads the pools through the table, SDPA reads a gathered copy)."""
    g = torch.Generator().manual_seed(1)
    B, Hq, Hkv, D, L, S_max, bs = 2, 6, 2, 16, 3, 64, 8
    T = 1 if case == "decode" else 5
    lens = torch.tensor([20, 20]) if case in ("decode", "tree") else torch.tensor([9, 23])
    window = 12 if case == "window" else 0
    q = torch.randn(B, Hq, T, D, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(B, Hkv, T, D, generator=g).to(torch.bfloat16) for _ in range(2))
    caches = [torch.randn(L, B, Hkv, S_max, D, generator=g).to(torch.bfloat16) for _ in range(2)]
    block = None
    if case == "tree":
        block = torch.tril(torch.ones(T, T, dtype=torch.bool)).expand(B, T, T).clone()
        block[:, 3, 1:3] = False
    pools, table = _paged_copy(caches, bs, g)
    ref = cache_attention(q, k, v, caches[0], caches[1], 1, lens, window, block, invariant)
    op = cache_attention if impl == "python" else cpu_attention.cache_attention
    got = op(q, k, v, pools[0], pools[1], 1, lens, window, block, invariant, table)
    assert torch.equal(got, ref)
    assert torch.equal(_rows_of(pools[0], table), caches[0]) and torch.equal(_rows_of(pools[1], table), caches[1])
    assert bool((pools[0][:, 0] == 0).all())


def test_the_invariant_kernel_reads_rows_through_a_block_table():
    g = torch.Generator().manual_seed(2)
    B, Hq, Hkv, T, D, S_max, bs = 3, 4, 2, 4, 32, 48, 16
    q = torch.randn(B, Hq, T, D, generator=g).to(torch.bfloat16)
    caches = [torch.randn(1, B, Hkv, S_max, D, generator=g).to(torch.bfloat16) for _ in range(2)]
    pools, table = _paged_copy(caches, bs, g)
    lens = torch.tensor([3, 30, 17])
    S = int(lens.max()) + T
    ref = cpu_attention.attention_rows(q, caches[0][0, :, :, :S], caches[1][0, :, :, :S], None, lens, 0)
    got = cpu_attention.attention_rows(q, pools[0][0], pools[1][0], None, lens, 0, table, S)
    assert torch.equal(got, ref)


def test_a_block_table_entry_outside_the_pool_is_refused():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 1, 16, generator=g).to(torch.bfloat16)
    k = torch.randn(1, 2, 1, 16, generator=g).to(torch.bfloat16)
    pools = [torch.zeros(1, 4, 2, 8, 16, dtype=torch.bfloat16) for _ in range(2)]
    table = torch.tensor([[1, 9]])  # block 9 of a 4-block pool
    lens = torch.tensor([10])
    with pytest.raises(RuntimeError, match="outside the pool"):
        cpu_attention.cache_attention(q, k, k, pools[0], pools[1], 0, lens, 0, None, True, table)
    with pytest.raises(RuntimeError, match="outside the pool"):
        cpu_attention.attention_rows(q, pools[0][0], pools[1][0], None, lens, 0, table, 11)
