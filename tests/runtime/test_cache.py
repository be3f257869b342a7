"""Static KV cache: preallocation, per-row lengths, rollback, compaction, memory check."""

import pytest
import torch

from runtime.cache import KVCache
from runtime.errors import CacheMemoryError, ContextLengthError
from runtime.tiny import tiny_model


def test_write_rollback_and_compaction_move_the_right_slots():
    cache = KVCache(2, 2, 3, 16, 4)
    kv = torch.arange(2 * 3 * 5 * 4, dtype=torch.float32).view(2, 3, 5, 4)  # (B, H, T, D)
    cache.write(0, kv, -kv, cache.slots(5))
    cache.lengths += 5
    assert torch.equal(cache.k[0, :, :, :5], kv)
    cache.rollback(torch.tensor([4, 2]))
    assert cache.lengths.tolist() == [4, 2]
    cache.lengths.fill_(5)
    cache.compact(torch.tensor([[1, 3, 4], [0, 2, 0]]), torch.tensor([1, 0]), torch.tensor([3, 2]))
    assert cache.lengths.tolist() == [4, 2]
    assert torch.equal(cache.k[0, 0, :, 1:4], kv[0, :, [1, 3, 4]])
    assert torch.equal(cache.v[0, 1, :, 0:2], -kv[1, :, [0, 2]])
    assert torch.equal(cache.k[0, 0, :, 0], kv[0, :, 0])  # the prefix is untouched


def test_rollback_cannot_grow_rows():
    cache = KVCache(1, 1, 1, 8, 2)
    with pytest.raises(ValueError, match="shorten"):
        cache.rollback(torch.tensor([3]))


def test_compacted_cache_gives_the_logits_of_a_fresh_prefill():
    model = tiny_model("llama", seed=5)
    prompt = torch.arange(1, 6)[None]  # 5 tokens
    with torch.no_grad():
        cache = model.new_cache(1, 32)
        model(prompt, torch.arange(5)[None], cache)
        # a block of 4 new tokens scored as a tree: keep slots 6 and 8 (tokens 21, 23)
        block = torch.tensor([[20, 21, 22, 23]])
        mask = torch.ones(1, 4, 9, dtype=torch.bool)
        mask[0, :, 5:] = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
        model(block, torch.tensor([[5, 6, 6, 7]]), cache, mask=mask)
        cache.compact(torch.tensor([[5, 6, 8]]), torch.tensor([5]), torch.tensor([3]))
        after = model(torch.tensor([[30]]), torch.tensor([[8]]), cache).logits
        seq = torch.tensor([[1, 2, 3, 4, 5, 20, 21, 23, 30]])
        fresh = model(seq, torch.arange(9)[None], model.new_cache(1, 32)).logits
    assert torch.allclose(after[0, -1], fresh[0, -1], atol=1e-5)


def test_a_cache_that_cannot_fit_fails_before_allocating():
    with pytest.raises(CacheMemoryError, match="GiB"):
        KVCache(64, 64, 32, 1 << 20, 128, dtype=torch.float32)


def test_writing_past_the_cache_is_an_error():
    model = tiny_model("llama", seed=6)
    cache = model.new_cache(1, 4)
    with pytest.raises(ContextLengthError, match="4 positions"):
        model(torch.zeros(1, 5, dtype=torch.long), torch.arange(5)[None], cache)
