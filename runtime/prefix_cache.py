"""Prefix caching: the keys and values of prompts already read, kept in blocks for later requests.

A `PrefixCache` is a preallocated pool of fixed-size blocks (`block` positions each) beside a
`KVCache`. Each full block of a row's tokens is keyed by a hash of every token up to its end
(vLLM's automatic prefix caching), so a block means one exact prefix and a shared system prompt or
an earlier turn of a conversation is stored once, whichever request read it. `put` copies the
full blocks of a row that the pool lacks into it; `get` finds the longest run of cached blocks a
prompt starts with and copies them into a row's first slots, so only the rest of the prompt is
prefilled. When the pool is full the least recently used block is overwritten (`evictions`
counts them); a lookup touches a prompt's blocks last-first, so a prefix outlives its extensions.

Blocks are copied, never read in place: every attention kernel keeps reading a row as one
contiguous range of its cache. A copy of n positions moves n x (2 x layers x kv heads x head dim)
values, far less than the n-token prefill it replaces.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import torch

from runtime.cache import HEADROOM, KVCache, available_memory
from runtime.errors import CacheMemoryError

DEFAULT_BLOCK = 16  # positions per block: the grain of reuse (a prompt reuses whole blocks only)


class PrefixCache:
    """Up to `tokens` positions of keys and values of `cache`'s shape, in blocks of `block`."""

    def __init__(self, cache: KVCache, tokens: int, block: int = DEFAULT_BLOCK) -> None:
        for name, value, low in (("tokens", tokens, block), ("block", block, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"a prefix cache's {name} must be an integer >= {low}, got {value!r}")
        L, _, H, _, D = cache.k.shape
        self.block, self.num_blocks = block, tokens // block
        shape = (L, self.num_blocks, H, block, D)
        need = 2 * L * self.num_blocks * H * block * D * cache.k.element_size()
        free = available_memory(cache.k.device)
        if need > HEADROOM * free:
            raise CacheMemoryError(f"a prefix cache of {tokens} positions needs {need / 2**30:.2f} GiB on "
                                   f"{cache.k.device}, but only {free / 2**30:.2f} GiB is free; keep fewer positions "
                                   "(prefix_cache_tokens, --prefix-cache-tokens; 0 turns it off)")
        self.k = torch.zeros(shape, dtype=cache.k.dtype, device=cache.k.device)  # (L, NB, H, block, D)
        self.v = torch.zeros(shape, dtype=cache.v.dtype, device=cache.v.device)
        self._ids: OrderedDict[bytes, int] = OrderedDict()  # prefix hash -> block id, least recently used first
        self._free = list(range(self.num_blocks - 1, -1, -1))  # block ids never used, popped from the end
        self.hits = self.lookups = self.looked_up_tokens = self.hit_tokens = self.evictions = 0

    @property
    def blocks_cached(self) -> int:
        return len(self._ids)

    @property
    def blocks_free(self) -> int:
        return self.num_blocks - len(self._ids)

    def _hashes(self, tokens: torch.Tensor, limit: int) -> list[bytes]:
        """The prefix hash of each of the first `limit` full blocks of `tokens`: a 128-bit BLAKE2b
        of the previous block's hash and this block's ids (not Python's hash, whose collisions a
        client could construct to read another request's keys)."""
        out, h = [], b""
        ids = tokens[:limit * self.block].to(torch.int64).cpu().numpy()
        for i in range(limit):
            h = hashlib.blake2b(h + ids[i * self.block:(i + 1) * self.block].tobytes(), digest_size=16).digest()
            out.append(h)
        return out

    def _found(self, prompt: torch.Tensor, keep: int) -> list[bytes]:
        """The hashes of the cached blocks `prompt` starts with, leaving `keep` tokens uncovered."""
        found = []
        for h in self._hashes(prompt, max(prompt.numel() - keep, 0) // self.block):
            if h not in self._ids:
                break
            found.append(h)
        return found

    def cached(self, prompt: torch.Tensor, keep: int = 1) -> int:
        """How many of `prompt`'s first tokens `get` would copy (nothing is copied or counted)."""
        return len(self._found(prompt, keep)) * self.block

    def get(self, prompt: torch.Tensor, cache: KVCache, row: int, keep: int = 1) -> int:
        """Copy the longest run of cached blocks `prompt` (1-D) starts with into slots [0, n) of
        `row` of `cache`, leaving at least `keep` prompt tokens uncovered; returns n (a multiple of
        the block size, 0 on a miss). The row's length is not changed."""
        found = self._found(prompt, keep)
        for h in reversed(found):  # last-first: the shortest prefix becomes the most recently used
            self._ids.move_to_end(h)
        self.lookups += 1
        self.looked_up_tokens += prompt.numel()
        if not found:
            return 0
        self.hits += 1
        ids = torch.tensor([self._ids[h] for h in found], device=self.k.device)
        n = len(found) * self.block
        L, _, H, _, D = self.k.shape
        # (L, m, H, block, D) -> (L, H, m * block, D)
        cache.k[:, row, :, :n] = self.k[:, ids].transpose(1, 2).reshape(L, H, n, D)
        cache.v[:, row, :, :n] = self.v[:, ids].transpose(1, 2).reshape(L, H, n, D)
        self.hit_tokens += n
        return n

    def put(self, tokens: torch.Tensor, cache: KVCache, row: int) -> int:
        """Keep the full blocks of `tokens` (1-D), whose keys and values are in slots [0, len) of
        `row` of `cache`, that the pool lacks (evicting the least recently used blocks); returns
        how many blocks were copied in."""
        hashes = self._hashes(tokens, min(tokens.numel() // self.block, self.num_blocks))
        copied = 0
        for i, h in enumerate(hashes):
            if h in self._ids:
                self._ids.move_to_end(h)
                continue
            if self._free:
                b = self._free.pop()
            else:
                _, b = self._ids.popitem(last=False)
                self.evictions += 1
            lo, hi = i * self.block, (i + 1) * self.block
            self.k[:, b] = cache.k[:, row, :, lo:hi]
            self.v[:, b] = cache.v[:, row, :, lo:hi]
            self._ids[h] = b
            copied += 1
        # last-first, as a lookup: the prompt's first blocks outlive its extensions
        for h in reversed(hashes):
            self._ids.move_to_end(h)
        return copied

    def clear(self) -> None:
        """Forget every block (after a fault that may have left bad values in a row)."""
        self._free = list(range(self.num_blocks - 1, -1, -1))
        self._ids.clear()
