"""Paged KV cache: blocks of a shared pool behind a block table give every reader the slots a
contiguous cache gives, bit for bit; blocks are taken, shared, freed and zeroed as the rows say."""

import pytest
import torch

from runtime.cache import KVCache
from runtime.errors import CacheMemoryError
from runtime.paged_cache import BlockPool, PagedKVCache
from runtime.tiny import tiny_model

L, B, H, D = 2, 3, 2, 4


def _pair(max_len=40, tokens=200, block=8, dtype=torch.float32):
    return KVCache(L, B, H, max_len, D, dtype=dtype), PagedKVCache(L, B, H, max_len, D, tokens, block, dtype=dtype)


def _scrambled(paged: PagedKVCache, upto: int) -> None:
    """Give every row blocks for [0, upto) in an interleaved order (row 0 takes a block, then row 1, ...),
    so no row's blocks are consecutive in the pool."""
    for n in range(1, paged.blocks_needed(upto) + 1):
        for r in range(paged.batch_size):
            paged.reserve(r, n * paged.block_size)


def _same_slots(a: KVCache, b: KVCache, num_keys: int) -> bool:
    return all(torch.equal(x, y) for layer in range(L) for x, y in zip(a.layer_kv(layer, num_keys),
                                                                        b.layer_kv(layer, num_keys)))


def test_writes_rollback_and_compaction_equal_a_contiguous_cache():
    plain, paged = _pair()
    _scrambled(paged, 32)
    g = torch.Generator().manual_seed(0)
    for T in (5, 7, 3):  # crosses block boundaries (blocks of 8)
        k, v = torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g)
        for cache in (plain, paged):
            for layer in range(L):
                cache.write(layer, k, v, cache.slots(T))
            cache.lengths += T
    assert _same_slots(plain, paged, 15)
    for cache in (plain, paged):
        cache.rollback(torch.tensor([13, 9, 15]))
    keep, start, count = torch.tensor([[13, 14, 15], [10, 11, 13], [9, 9, 9]]), torch.tensor([12, 9, 9]), \
        torch.tensor([3, 2, 0])
    for cache in (plain, paged):
        cache.lengths.fill_(16)
        cache.compact(keep, start, count)
    assert plain.lengths.tolist() == paged.lengths.tolist() == [15, 11, 9]
    assert _same_slots(plain, paged, 15)
    for row, lo, n in ((0, 3, 9), (1, 0, 11), (2, 7, 2)):
        assert all(torch.equal(x, y) for x, y in zip(plain.read_row(row, lo, n), paged.read_row(row, lo, n)))


def test_slots_without_a_block_read_zeros_and_drop_their_writes():
    paged = PagedKVCache(L, 2, H, 32, D, 64, 8)
    paged.reserve(0, 8)  # row 0: one block; row 1: none (a free row riding along)
    k = torch.ones(2, H, 10, D)
    for layer in range(L):
        paged.write(layer, k, k, paged.slots(10))
    assert bool((paged.k[:, 0] == 0).all())  # the null block was never written
    keys, _ = paged.layer_kv(0, 10)
    assert bool((keys[0, :, :8] == 1).all()) and bool((keys[0, :, 8:] == 0).all())
    assert bool((keys[1] == 0).all())


def test_blocks_are_taken_shared_and_given_back():
    paged = PagedKVCache(L, 3, H, 64, D, 6 * 8, 8)
    assert (paged.num_blocks, paged.blocks_free) == (6, 6)
    paged.reserve(0, 20)  # 3 blocks
    paged.write_row(0, 0, torch.randn(L, H, 20, D), torch.randn(L, H, 20, D))
    paged.share(0, 1, 19)  # 2 full blocks by reference, 3 positions copied into a block of row 1's own
    assert paged.held(1) == 3 and paged.blocks_in_use == 4
    assert all(torch.equal(x, y) for x, y in zip(paged.read_row(0, 0, 19), paged.read_row(1, 0, 19)))
    assert paged.block_table[1, :2].tolist() == paged.block_table[0, :2].tolist()
    assert paged.block_table[1, 2] != paged.block_table[0, 2]
    paged.free_row(0, zero=True)  # its shared blocks stay (row 1 holds them) and keep their values
    assert paged.blocks_in_use == 3 and paged.held(0) == 0 and int(paged.lengths[0]) == 0
    assert bool((paged.read_row(1, 0, 16)[0] != 0).any())
    with pytest.raises(CacheMemoryError, match="kv-cache-tokens"):
        paged.reserve(2, 5 * 8)  # 5 blocks, 3 free
    assert paged.blocks_in_use == 3  # nothing taken by the refused reservation
    with pytest.raises(ValueError, match="already holds"):
        paged.share(1, 1, 8)
    paged.free_row(1)
    assert paged.blocks_free == 6


def test_a_faulty_rows_freed_blocks_are_zeroed():
    paged = PagedKVCache(L, 1, H, 32, D, 32, 8)
    paged.write_row(0, 0, torch.full((L, H, 12, D), float("nan")), torch.full((L, H, 12, D), float("nan")))
    paged.free_row(0, zero=True)
    assert not bool(paged.k.isnan().any()) and not bool(paged.v.isnan().any())


def test_the_pool_counts_references():
    pool = BlockPool(3)
    a, b = pool.take(), pool.take()
    assert (a, b, pool.free) == (1, 2, 0)
    with pytest.raises(CacheMemoryError):
        pool.take()
    pool.retain(a)
    assert not pool.drop(a) and pool.drop(a) and pool.free == 1
    with pytest.raises(ValueError, match="already free"):
        pool.drop(a)
    with pytest.raises(ValueError, match="free"):
        pool.retain(a)


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="num_tokens"):
        PagedKVCache(L, B, H, 32, D, 0)
    with pytest.raises(ValueError, match="block_size"):
        PagedKVCache(L, B, H, 32, D, 64, block_size=True)
    with pytest.raises(CacheMemoryError, match="GiB"):
        PagedKVCache(64, 4, 32, 1 << 20, 128, 1 << 34)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forwards_through_a_paged_cache_equal_the_contiguous_ones(dtype):
    """Prefill, then decode steps and verification blocks of 1-3 tokens with rejections between
    them: logits equal bit for bit (bf16: the row-invariant kernel reading through the table)."""
    model = tiny_model("llama", seed=1).to(dtype)
    cfg = model.config
    plain = model.new_cache(B, 48)
    paged = model.new_cache(B, 48, paged_tokens=B * 48)
    _scrambled(paged, 48)
    assert isinstance(paged, PagedKVCache) and model.row_invariant == (dtype == torch.bfloat16)
    prompt = torch.randint(0, cfg.vocab_size, (B, 11), generator=torch.Generator().manual_seed(2))
    outs = []
    for cache in (plain, paged):
        g = torch.Generator().manual_seed(3)
        with torch.inference_mode():
            logits = [model(prompt, torch.arange(11)[None].expand(B, -1), cache).logits]
            for T in (1, 3, 2, 3, 1):
                tokens = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
                logits.append(model(tokens, cache.lengths[:, None] + torch.arange(T), cache).logits)
                cache.rollback(cache.lengths - (T - 1))
        outs.append(logits)
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_a_compiled_step_through_a_paged_cache_equals_the_contiguous_one():
    """bf16, compiled: the C++ cache op writes and reads the pools through the table; a step's
    padding past a row's blocks is dropped."""
    model = tiny_model("llama", seed=4).to(torch.bfloat16).compile_decode()
    cfg = model.config
    plain = model.new_cache(2, 40)
    paged = model.new_cache(2, 40, paged_tokens=96)
    prompt = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(5))
    outs = []
    for cache in (plain, paged):
        g = torch.Generator().manual_seed(6)
        logits = []
        with torch.inference_mode():
            for r in range(2):
                cache.reserve(r, 9 + 2)  # what the engine does: the prompt and one step's tokens
                logits.append(model(prompt[r:r + 1], torch.arange(9)[None], cache.rows(r)).logits)
            for T in (1, 2, 1):
                for r in range(2):
                    cache.reserve(r, int(cache.lengths[r]) + T)
                tokens = torch.randint(0, cfg.vocab_size, (2, T), generator=g)
                logits.append(model(tokens, cache.lengths[:, None] + torch.arange(T), cache).logits)
        outs.append(logits)
    assert paged.blocks_in_use == 2  # blocks of 16: 13 slots a row
    for a, b in zip(*outs):
        assert torch.equal(a, b)
