"""The C++ cache attention of compiled CPU steps gives the Python op's numbers and cache writes."""

import pytest
import torch

from runtime.attention import cache_attention
from runtime.kernels import cpu_attention, cpu_blockq

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


def _attention_cases(g: torch.Generator):
    """(name, attention_rows arguments): decode and verification blocks of grouped-query heads, head
    dims with and without a tail of 16, cache lengths off a multiple of 16, masks, a window, a strided
    cache view and a paged cache, in bf16 and float32."""
    for dtype in (torch.bfloat16, torch.float32):
        for B, Hq, Hkv, T, S, D in [(1, 12, 2, 1, 300, 128), (1, 12, 2, 8, 333, 128), (2, 6, 2, 5, 77, 40),
                                    (3, 4, 4, 3, 50, 64), (1, 8, 2, 17, 90, 96)]:
            q = torch.randn(B, Hq, T, D, generator=g).to(dtype)
            k, v = (torch.randn(B, Hkv, S + 9, D, generator=g).to(dtype) for _ in range(2))
            pre = torch.randint(0, S - T + 1, (B,), generator=g)
            name = f"{dtype} {(B, Hq, Hkv, T, S, D)}"
            keys, values = k[:, :, :S].contiguous(), v[:, :, :S].contiguous()
            yield f"{name} causal", (q, keys, values, None, pre, 0)
            yield f"{name} window", (q, keys, values, None, pre, 7)
            yield f"{name} mask", (q, keys, values, torch.rand(B, T, S, generator=g) < 0.4, pre, 0)
            yield f"{name} view", (q, k[:, :, :S], v[:, :, :S], None, pre, 0)
    q = torch.randn(3, 4, 4, 32, generator=g).to(torch.bfloat16)
    caches = [torch.randn(1, 3, 2, 48, 32, generator=g).to(torch.bfloat16) for _ in range(2)]
    pools, table = _paged_copy(caches, 16, g)
    yield "paged", (q, pools[0][0], pools[1][0], None, torch.tensor([3, 30, 17]), 0, table, 34)


def test_every_build_of_the_invariant_kernel_gives_the_same_bits(monkeypatch):
    """The AVX-512, AVX2 and portable builds of attention_rows (`SPECDEC_ATTENTION_ISA`) give the bits of
    the CPU's default build on every case; each build the CPU has runs."""
    cases = list(_attention_cases(torch.Generator().manual_seed(7)))
    want = {name: cpu_attention.attention_rows(*args) for name, args in cases}
    ran = []
    for build in ("avx512", "avx2", "generic"):
        monkeypatch.setenv(cpu_attention.ISA_ENV, build)
        try:
            got = {name: cpu_attention.attention_rows(*args) for name, args in cases}
        except RuntimeError as err:
            assert "does not run" in str(err)
            continue
        ran.append(build)
        assert [name for name in want if not torch.equal(got[name], want[name])] == [], build
    assert "generic" in ran
    assert ("vnni" not in cpu_blockq.isas() or "avx512" in ran) and ("avx2" not in cpu_blockq.isas() or "avx2" in ran)
    monkeypatch.setenv(cpu_attention.ISA_ENV, "sse9")
    with pytest.raises(RuntimeError, match="not an attention build"):
        cpu_attention.attention_rows(*cases[0][1])
