"""Prefix caching: the keys and values of prompts already read, kept in blocks for later requests.

A `PrefixCache` is a preallocated pool of fixed-size blocks (`block` positions each) beside a
`KVCache`. Each full block of a row's tokens is keyed by a hash of every token up to its end
(vLLM's automatic prefix caching), so a block means one exact prefix and a shared system prompt or
an earlier turn of a conversation is stored once, whichever request read it. The tokens after a
row's last full block are kept too, as a partial block keyed by its prefix and its own tokens.

`put` copies the blocks of a row that the pool lacks into it. `get` finds the longest run of
cached full blocks a prompt starts with, then, among the blocks cached right after that run (full
or partial: the children of its last block), the one sharing the most leading tokens with the rest
of the prompt, and copies all of that into a row's first slots: reuse is token by token, as
llama-server's slot cache (keys and values of a position depend only on the tokens up to it), and
only the rest of the prompt is prefilled. When the pool is full the least recently used block is
overwritten (`evictions` counts them); a lookup touches a prompt's blocks last-first, so a prefix
outlives its extensions.

Here blocks are copied into a row (`KVCache.write_row`): a copy of n positions moves n x (2 x layers
x kv heads x head dim) values, far less than the n-token prefill it replaces. `PagedPrefixCache` keeps
the blocks of a paged cache's own pool instead, and hands full blocks to rows by reference.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import torch

from runtime.cache import HEADROOM, KVCache, available_memory
from runtime.errors import CacheMemoryError
from runtime.paged_cache import PagedKVCache

DEFAULT_BLOCK = 16  # positions per block: the grain of the hashed lookup (reuse itself is token by token)
_ROOT = b""  # the parent of a prompt's first block


class PrefixCache:
    """Up to `tokens` positions of keys and values of `cache`'s shape, in blocks of `block`."""

    def __init__(self, cache: KVCache, tokens: int, block: int = DEFAULT_BLOCK) -> None:
        for name, value, low in (("tokens", tokens, block), ("block", block, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"a prefix cache's {name} must be an integer >= {low}, got {value!r}")
        L, H, D = cache.k.shape[0], cache.k.shape[2], cache.k.shape[4]  # (L, B | NB, H, S_max | bs, D)
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
        self._index(self.num_blocks)
        self._free = list(range(self.num_blocks - 1, -1, -1))  # block ids never used, popped from the end

    def _index(self, ids: int) -> None:
        """The empty index over block ids [0, ids)."""
        self._ids: OrderedDict[bytes, int] = OrderedDict()  # block key -> block id, least recently used first
        self._parent: dict[bytes, bytes] = {}  # block key -> the key of the block before it (_ROOT first)
        self._children: dict[bytes, dict[bytes, None]] = {}  # key -> keys of the blocks cached after it
        self._tokens = torch.zeros(ids, self.block, dtype=torch.int64)  # (ids, block): each block's token ids
        self._length = torch.zeros(ids, dtype=torch.int64)  # (ids,): block, or fewer (a partial one)
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
        out, h = [], _ROOT
        ids = tokens[:limit * self.block].to(torch.int64).cpu().numpy()
        for i in range(limit):
            h = hashlib.blake2b(h + ids[i * self.block:(i + 1) * self.block].tobytes(), digest_size=16).digest()
            out.append(h)
        return out

    @staticmethod
    def _partial_key(parent: bytes, tokens: torch.Tensor) -> bytes:
        """The key of a partial block: its parent's key and its ids (a separate BLAKE2b domain)."""
        data = parent + tokens.to(torch.int64).cpu().numpy().tobytes()
        return hashlib.blake2b(data, digest_size=16, person=b"specdec-partial").digest()

    def _best_child(self, parent: bytes, rest: torch.Tensor) -> tuple[bytes | None, int]:
        """Among the blocks cached after `parent`, the one whose leading ids match the most of `rest`
        (1-D, at most a block): (its key, how many), or (None, 0)."""
        children = self._children.get(parent)
        if not children or rest.numel() == 0:
            return None, 0
        keys = list(children)
        ids = torch.tensor([self._ids[k] for k in keys])
        n = rest.numel()
        same = (self._tokens[ids, :n] == rest.to(torch.int64).cpu()[None]).long().cumprod(1).sum(1)  # (c,)
        same = torch.minimum(same, self._length[ids])
        best = int(same.argmax())
        return (keys[best], int(same[best])) if int(same[best]) else (None, 0)

    def _found(self, prompt: torch.Tensor, keep: int) -> tuple[list[bytes], bytes | None, int]:
        """What `prompt` reuses, leaving `keep` tokens uncovered: the keys of the cached full blocks
        it starts with, then the key of the block after them sharing the most tokens with the rest
        of it (None if none) and how many it shares."""
        limit = max(prompt.numel() - keep, 0)
        found = []
        for h in self._hashes(prompt, limit // self.block):
            if h not in self._ids:
                break
            found.append(h)
        start = len(found) * self.block
        key, m = self._best_child(found[-1] if found else _ROOT, prompt[start:min(limit, start + self.block)])
        return found, key, m

    def cached(self, prompt: torch.Tensor, keep: int = 1) -> int:
        """How many of `prompt`'s first tokens `get` would copy (nothing is copied or counted)."""
        found, _, m = self._found(prompt, keep)
        return len(found) * self.block + m

    def get(self, prompt: torch.Tensor, cache: KVCache, row: int, keep: int = 1) -> int:
        """Copy what `prompt` (1-D) reuses (`_found`) into slots [0, n) of `row` of `cache`, leaving
        at least `keep` prompt tokens uncovered; returns n (0 on a miss). The row's length is not
        changed."""
        found, key, m = self._found(prompt, keep)
        if key is not None:
            self._ids.move_to_end(key)
        for h in reversed(found):  # last-first: the shortest prefix becomes the most recently used
            self._ids.move_to_end(h)
        self.lookups += 1
        self.looked_up_tokens += prompt.numel()
        if not found and key is None:
            return 0
        self.hits += 1
        n = len(found) * self.block
        self._load(cache, row, [self._ids[h] for h in found], None if key is None else self._ids[key], m)
        n += m
        self.hit_tokens += n
        return n

    def _load(self, cache: KVCache, row: int, full: list[int], child: int | None, m: int) -> None:
        """Put the cached blocks `full` into slots [0, n) of `row`, then the first m positions of
        block `child` (if any) after them: copies here."""
        n = len(full) * self.block
        L, _, H, _, D = self.k.shape
        if full:
            ids = torch.tensor(full, device=self.k.device)
            # (L, m, H, block, D) -> (L, H, m * block, D)
            cache.write_row(row, 0, self.k[:, ids].transpose(1, 2).reshape(L, H, n, D),
                            self.v[:, ids].transpose(1, 2).reshape(L, H, n, D))
        if child is not None:
            cache.write_row(row, n, self.k[:, child, :, :m], self.v[:, child, :, :m])

    def _store(self, key: bytes, parent: bytes, tokens: torch.Tensor, cache: KVCache, row: int, lo: int) -> bool:
        """Keep positions lo .. lo + len(tokens) - 1 of `row` in a block under `key`; False when no
        block could be had (a paged cache's partial block, the pool full)."""
        b = self._keep(cache, row, lo, tokens.numel())
        if b is None:
            return False
        self._tokens[b, :tokens.numel()] = tokens.to(torch.int64).cpu()
        self._length[b] = tokens.numel()
        self._ids[key] = b
        self._parent[key] = parent
        self._children.setdefault(parent, {})[key] = None
        return True

    def _keep(self, cache: KVCache, row: int, lo: int, n: int) -> int | None:
        """A block holding positions [lo, lo + n) of `row`: copied into a free block of the pool, or
        into the least recently used one."""
        b = self._free.pop() if self._free else self._forget(next(iter(self._ids)))
        self.k[:, b, :, :n], self.v[:, b, :, :n] = cache.read_row(row, lo, n)
        return b

    def _forget(self, key: bytes) -> int:
        """Evict the block under `key` from the index (`evictions` counts it); returns its id."""
        b = self._ids.pop(key)
        self.evictions += 1
        up = self._parent.pop(key)
        del self._children[up][key]
        if not self._children[up]:
            del self._children[up]
        return b

    def put(self, tokens: torch.Tensor, cache: KVCache, row: int) -> int:
        """Keep the blocks of `tokens` (1-D), whose keys and values are in slots [0, len) of `row` of
        `cache`, that the pool lacks: its full blocks, then the tokens after them as a partial block
        unless a cached block already starts with them (evicting the least recently used blocks);
        returns how many blocks were stored."""
        full = tokens.numel() // self.block
        hashes = self._hashes(tokens, min(full, self.num_blocks))
        copied, touched = 0, list(hashes)
        for i, h in enumerate(hashes):
            if h in self._ids:
                self._ids.move_to_end(h)
                continue
            lo = i * self.block
            self._store(h, hashes[i - 1] if i else _ROOT, tokens[lo:lo + self.block], cache, row, lo)
            copied += 1
        tail = tokens[full * self.block:]
        parent = hashes[-1] if hashes else _ROOT
        # the tail hangs below the last full block, which an eviction above may have taken
        if len(hashes) == full and tail.numel() and (parent == _ROOT or parent in self._ids):
            key, m = self._best_child(parent, tail)
            if m < tail.numel():  # no cached block holds these tokens yet
                key = self._partial_key(parent, tail)
                if key not in self._ids and self._store(key, parent, tail, cache, row, full * self.block):
                    copied += 1
            touched.append(key)
        # last-first, as a lookup: the prompt's first blocks outlive its extensions
        for h in reversed(touched):
            if h in self._ids:
                self._ids.move_to_end(h)
        return copied

    def clear(self) -> None:
        """Forget every block (after a fault that may have left bad values in a row)."""
        self._free = list(range(self.num_blocks - 1, -1, -1))
        self._ids.clear()
        self._parent.clear()
        self._children.clear()


class PagedPrefixCache(PrefixCache):
    """The prefix cache of a paged KV cache (`runtime.paged_cache.PagedKVCache`): its blocks are
    blocks of the rows' own pool, held by reference.

    `put` keeps a row's full blocks by taking a reference to them (no copy: a row never writes below
    its length again, so they stay as they are) and copies only a partial tail block into a block of
    its own (the row goes on writing into its tail). `get` gives an empty row the cached full blocks
    by reference and copies the leading positions of the cached block after them into a block of the
    row's own: copy on write at the first block the row will write, so n requests of one prompt hold
    its full blocks once. A cached block that no row holds is free memory waiting to be asked for:
    when a row needs blocks and the pool has none free, the least recently used such blocks are
    evicted (`evict`, which the cache calls). At most `tokens` positions are indexed (None: the
    whole pool)."""

    def __init__(self, cache: PagedKVCache, tokens: int | None = None) -> None:
        if not isinstance(cache, PagedKVCache):
            raise TypeError(f"a paged prefix cache goes with a PagedKVCache, got {type(cache).__name__}")
        self.block = cache.block_size
        if tokens is None:
            tokens = cache.num_blocks * self.block
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < self.block:
            raise ValueError(f"a prefix cache's tokens must be an integer >= {self.block}, got {tokens!r}")
        self.num_blocks = tokens // self.block
        self.kv = cache
        self._index(len(cache.pool.refs))  # indexed by pool block id
        cache.evict = self.evict

    @property
    def evictable(self) -> int:
        """Cached blocks that no row holds: free as soon as a row needs them."""
        refs = self.kv.pool.refs
        return sum(refs[b] == 1 for b in self._ids.values())

    def evict(self, need: int) -> None:
        """Evict the least recently used cached blocks that no row holds until the pool has `need`
        free blocks (or no such block is left)."""
        refs = self.kv.pool.refs
        for key in [k for k, b in self._ids.items() if refs[b] == 1]:
            if self.kv.pool.free >= need:
                return
            self.kv.pool.drop(self._forget(key))

    def _load(self, cache: KVCache, row: int, full: list[int], child: int | None, m: int) -> None:
        if cache is not self.kv:
            raise ValueError("a paged prefix cache serves the rows of its own KV cache")
        cache.adopt(row, full)
        if child is not None:
            n = len(full) * self.block
            cache.write_row(row, n, cache.k[:, child, :, :m], cache.v[:, child, :, :m])

    def _keep(self, cache: KVCache, row: int, lo: int, n: int) -> int | None:
        if cache is not self.kv:
            raise ValueError("a paged prefix cache keeps the rows of its own KV cache")
        if n == self.block:  # a full block (below the row's length: it holds one there), by reference
            self._make_room()
            b = int(cache.block_table[row, lo // self.block])
            cache.pool.retain(b)
            return b
        if not cache.pool.free:
            self.evict(1)
        if not cache.pool.free:
            return None
        self._make_room()
        b = cache.pool.take()
        k, v = cache.read_row(row, lo, n)  # (L, H, n, D)
        cache.k[:, b, :, :n], cache.v[:, b, :, :n] = k, v
        return b

    def _make_room(self) -> None:
        """Forget the least recently used entry when the index holds its `num_blocks` already."""
        if len(self._ids) >= self.num_blocks:
            self.kv.pool.drop(self._forget(next(iter(self._ids))))

    def clear(self) -> None:
        for b in self._ids.values():
            self.kv.pool.drop(b)
        self._ids.clear()
        self._parent.clear()
        self._children.clear()
