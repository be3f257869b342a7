"""The prefix cache: blocks keyed by their whole prefix, reused token by token, copied exactly, evicted least
recently used."""

import pytest
import torch

from runtime.cache import KVCache
from runtime.prefix_cache import PrefixCache


def _filled(rows: int = 2, slots: int = 64, seed: int = 0) -> KVCache:
    cache = KVCache(num_layers=2, batch_size=rows, num_kv_heads=2, max_seq_len=slots, head_dim=4)
    g = torch.Generator().manual_seed(seed)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    return cache


def test_a_prompt_gets_the_cached_blocks_it_starts_with_bit_for_bit():
    cache = _filled()
    pc = PrefixCache(cache, tokens=64, block=4)
    tokens = torch.arange(10)
    assert pc.put(tokens, cache, row=0) == 3  # two full blocks and a partial one of the last 2 tokens
    prompt = torch.cat([tokens[:9], torch.tensor([50, 51])])
    assert pc.cached(prompt) == 9  # 2 blocks, then 1 token of the partial one
    n = pc.get(prompt, cache, row=1)
    assert n == 9
    assert torch.equal(cache.k[:, 1, :, :9], cache.k[:, 0, :, :9])
    assert torch.equal(cache.v[:, 1, :, :9], cache.v[:, 0, :, :9])
    assert not torch.equal(cache.k[:, 1, :, 9], cache.k[:, 0, :, 9])  # nothing past what matched
    assert (pc.lookups, pc.hits, pc.hit_tokens, pc.looked_up_tokens) == (1, 1, 9, 11)


def test_reuse_is_token_by_token_after_the_last_full_block():
    """A prompt that leaves a cached full block midway reuses its leading tokens; a resent
    conversation reuses the partial block of the earlier answer whole."""
    cache = _filled()
    pc = PrefixCache(cache, tokens=64, block=4)
    pc.put(torch.arange(12), cache, row=0)
    prompt = torch.cat([torch.arange(6), torch.tensor([77, 78])])
    assert pc.get(prompt, cache, row=1) == 6
    assert torch.equal(cache.k[:, 1, :, :6], cache.k[:, 0, :, :6])
    assert pc.put(torch.arange(6), cache, row=0) == 0  # its last 2 tokens start a cached block
    assert pc.cached(torch.arange(3)) == 2  # one token kept to prefill
    history = torch.arange(100, 110)  # a turn's prompt and answer: 2 full blocks and 2 tokens
    pc.put(history, cache, row=1)
    assert pc.get(torch.cat([history, torch.tensor([5, 6, 7])]), cache, row=0) == 10
    assert torch.equal(cache.v[:, 0, :, :10], cache.v[:, 1, :, :10])


def test_an_evicted_partial_block_is_never_matched():
    cache = _filled()
    pc = PrefixCache(cache, tokens=8, block=4)  # two blocks
    pc.put(torch.arange(6), cache, row=0)  # a full block and a partial one of 2 tokens
    pc.put(torch.arange(50, 54), cache, row=1)  # evicts the partial one (touched before the full one)
    assert pc.evictions == 1
    assert pc.cached(torch.arange(8)) == 4 and pc.cached(torch.arange(50, 56)) == 4


def test_a_block_means_its_whole_prefix_and_a_prompt_keeps_one_token_to_prefill():
    cache = _filled()
    pc = PrefixCache(cache, tokens=64, block=4)
    pc.put(torch.arange(8), cache, row=0)
    other_start = torch.tensor([9, 1, 2, 3, 4, 5, 6, 7, 8])  # block 2 equal, block 1 not: no hit
    assert pc.get(other_start, cache, row=1) == 0 and pc.hits == 0
    assert pc.cached(torch.arange(8)) == 7  # the whole prompt cached: its last token is prefilled
    assert pc.cached(torch.arange(8), keep=0) == 8
    assert pc.cached(torch.tensor([1, 2, 3])) == 0


def test_put_copies_only_the_blocks_the_pool_lacks():
    cache = _filled()
    pc = PrefixCache(cache, tokens=64, block=4)
    assert pc.put(torch.arange(8), cache, row=0) == 2
    assert pc.put(torch.arange(16), cache, row=0) == 2
    assert pc.blocks_cached == 4 and pc.blocks_free == 12


def test_the_least_recently_used_block_is_evicted_and_a_prefix_outlives_its_extensions():
    cache = _filled(slots=64)
    pc = PrefixCache(cache, tokens=12, block=4)  # three blocks
    a, b = torch.arange(8), torch.arange(100, 108)
    pc.put(a, cache, row=0)
    pc.put(b, cache, row=1)  # a's second block is evicted: a's first was used after it
    assert pc.evictions == 1
    assert pc.cached(torch.cat([a, torch.tensor([7])])) == 4
    assert pc.cached(torch.cat([b, torch.tensor([7])])) == 8
    pc.get(torch.cat([a, torch.tensor([7])]), cache, row=1)  # a's first block is now the newest
    pc.put(torch.arange(200, 204), cache, row=0)
    assert pc.evictions == 2  # b's second block: b's first was touched after it
    assert pc.cached(torch.cat([b, torch.tensor([7])])) == 4
    assert pc.cached(torch.cat([a, torch.tensor([7])])) == 4


def test_clear_forgets_every_block():
    cache = _filled()
    pc = PrefixCache(cache, tokens=64, block=4)
    pc.put(torch.arange(16), cache, row=0)
    pc.clear()
    assert pc.blocks_cached == 0 and pc.cached(torch.arange(17)) == 0


@pytest.mark.parametrize("kw", [dict(tokens=3, block=4), dict(tokens=16, block=0), dict(tokens=True, block=4),
                                dict(tokens=16.0, block=4)])
def test_bad_sizes_are_refused(kw):
    with pytest.raises(ValueError, match="prefix cache"):
        PrefixCache(_filled(), **kw)


def test_a_pool_that_does_not_fit_in_memory_is_refused_by_name(monkeypatch):
    import runtime.prefix_cache
    from runtime.errors import CacheMemoryError

    monkeypatch.setattr(runtime.prefix_cache, "available_memory", lambda device: 1000)
    with pytest.raises(CacheMemoryError, match="prefix_cache_tokens"):
        PrefixCache(_filled(), tokens=64, block=4)


def _paged(rows: int = 3, blocks: int = 8, block: int = 4):
    from runtime.paged_cache import PagedKVCache

    cache = PagedKVCache(2, rows, 2, 64, 4, blocks * block, block)
    g = torch.Generator().manual_seed(1)
    cache.reserve(0, 10)
    cache.write_row(0, 0, torch.randn(2, 2, 10, 4, generator=g), torch.randn(2, 2, 10, 4, generator=g))
    cache.lengths[0] = 10
    return cache


def test_a_paged_prefix_cache_holds_full_blocks_by_reference_and_copies_the_tail():
    from runtime.prefix_cache import PagedPrefixCache

    cache = _paged()
    pc = PagedPrefixCache(cache)
    assert pc.put(torch.arange(10), cache, row=0) == 3  # 2 full blocks by reference, the 2-token tail copied
    assert cache.blocks_in_use == 4 and pc.evictable == 1  # the row's 3 blocks, and the tail's copy
    row0 = cache.block_table[0, :2].tolist()
    assert [cache.pool.refs[b] for b in row0] == [2, 2]
    prompt = torch.cat([torch.arange(9), torch.tensor([50, 51])])
    assert pc.get(prompt, cache, row=1) == 9
    assert cache.block_table[1, :2].tolist() == row0  # adopted, not copied
    assert cache.block_table[1, 2] not in (cache.block_table[0, 2], 0)  # the partial block: the row's own copy
    assert all(torch.equal(a, b) for a, b in zip(cache.read_row(1, 0, 9), cache.read_row(0, 0, 9)))
    cache.free_row(0)
    cache.free_row(1)
    assert cache.blocks_in_use == pc.evictable == 3  # only the cache holds its blocks now


def test_a_row_that_needs_blocks_evicts_the_least_recently_used_cached_ones():
    from runtime.prefix_cache import PagedPrefixCache

    cache = _paged(blocks=5)
    pc = PagedPrefixCache(cache)
    pc.put(torch.arange(10), cache, row=0)
    cache.free_row(0)
    assert (cache.blocks_free, pc.evictable) == (2, 3)
    cache.reserve(1, 16)  # 4 blocks: 2 free, 2 evicted (the tail first: a lookup touches blocks last-first)
    assert cache.held(1) == 4 and pc.evictions == 2 and pc.blocks_cached == 1
    assert pc.cached(torch.arange(10)) == 4  # the first block outlived its extensions
    with pytest.raises(Exception, match="kv-cache-tokens"):
        cache.reserve(2, 8)  # 2 blocks: 1 evictable left, then none
    assert pc.blocks_cached == 0 and cache.blocks_free == 1
