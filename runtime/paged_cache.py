"""Paged KV cache: the slots of every row in blocks of one shared pool, found through a block table.

`PagedKVCache` is a `runtime.cache.KVCache` (same slots, lengths, rollback, compaction, row views)
whose keys and values live in a pool `k`, `v` of shape (L, NB, H_kv, block, D). Row b's slot s is
position s % block of pool block `block_table[b, s // block]` (vLLM's PagedAttention). Block 0 is
the null block: a table entry 0 means "no block", reads there give zeros and writes there are
dropped, so rows that hold no request (free rows riding along a batch, the padding of a compiled
step past a row's blocks) cost no memory and leave nothing behind.

Memory follows what rows hold: `reserve(row, upto)` gives a row blocks for its slots [0, upto)
before a forward writes them, `free_row` returns them, and `share(src, dst, n)` lets a row start
with another row's first n slots by referencing its full blocks (reference counts; a row only ever
writes at slots at or past its length, so a block wholly below both rows' lengths is never written
again and needs no copy on write) and copying the partial one.

Attention reads through the table: the row-invariant kernel (`runtime.invariant`, and the compiled
CPU step's `cache_attention`) looks keys up per block as it converts them; the other paths gather a
layer's used blocks into contiguous (B, H, S, D) tensors first (`layer_kv`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from runtime.cache import HEADROOM, KVCache, available_memory
from runtime.errors import CacheMemoryError

DEFAULT_BLOCK = 16  # positions per block (the prefix cache's grain too)


def paged_write(k_pool: torch.Tensor, v_pool: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor,
                slots: torch.Tensor, block_table: torch.Tensor) -> None:
    """Store k, v (B, H, T, D) at the rows' `slots` (B, T) of `layer` of the pools (L, NB, H, bs, D),
    through `block_table` (B, W); slots without a block (entry 0) are dropped."""
    bs = k_pool.shape[3]
    blocks, pos = block_table.gather(1, slots // bs), slots % bs  # (B, T)
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # (B, T, H, D)
    held = blocks != 0
    if not bool(held.all()):  # a free row, the padding of a compiled step past a row's blocks
        blocks, pos, k, v = blocks[held], pos[held], k[held], v[held]
    k_pool[layer][blocks, :, pos] = k  # into (NB, H, bs, D)
    v_pool[layer][blocks, :, pos] = v


def paged_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, layer: int, block_table: torch.Tensor,
             num_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots [0, num_keys) of every row of `layer` of the pools (L, NB, H, bs, D), gathered through
    `block_table` (B, W): keys and values (B, H, S, D), copies."""
    _, _, H, bs, D = k_pool.shape
    n = -(-num_keys // bs)
    ids = block_table[:, :n]  # (B, n)
    B = ids.shape[0]
    keys = k_pool[layer][ids].transpose(1, 2).reshape(B, H, n * bs, D)[:, :, :num_keys]  # (B, n, H, bs, D) -> ...
    values = v_pool[layer][ids].transpose(1, 2).reshape(B, H, n * bs, D)[:, :, :num_keys]
    return keys, values


class BlockPool:
    """Reference-counted block ids 1 .. num_blocks - 1 (0 is the null block): `take` a free one,
    `retain` a shared one, `drop` a reference (the block is free again at zero)."""

    def __init__(self, num_blocks: int) -> None:
        self.refs = [0] * num_blocks
        self._free = list(range(num_blocks - 1, 0, -1))  # popped from the end: low ids first

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self) -> int:
        if not self._free:
            raise CacheMemoryError(f"the KV cache's {len(self.refs) - 1} blocks are all in use; start the engine "
                                   "with more KV cache tokens (--kv-cache-tokens) or fewer rows (--max-batch)")
        b = self._free.pop()
        self.refs[b] = 1
        return b

    def retain(self, b: int) -> None:
        if self.refs[b] < 1:
            raise ValueError(f"block {b} is free: only a block in use can be shared")
        self.refs[b] += 1

    def drop(self, b: int) -> bool:
        """One reference less to block `b`; True when that freed it."""
        if self.refs[b] < 1:
            raise ValueError(f"block {b} is already free")
        self.refs[b] -= 1
        if self.refs[b]:
            return False
        self._free.append(b)
        return True


class PagedKVCache(KVCache):
    """`batch_size` rows of up to `max_seq_len` slots over a pool of `num_tokens` positions (rounded
    up to whole blocks of `block_size`); see the module docstring."""

    def __init__(self, num_layers: int, batch_size: int, num_kv_heads: int, max_seq_len: int, head_dim: int,
                 num_tokens: int, block_size: int = DEFAULT_BLOCK, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        for name, value, low in (("num_tokens", num_tokens, 1), ("block_size", block_size, 1),
                                 ("batch_size", batch_size, 1), ("max_seq_len", max_seq_len, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"a paged KV cache's {name} must be an integer >= {low}, got {value!r}")
        device = torch.device(device)
        num_blocks = -(-num_tokens // block_size) + 1  # + the null block
        elem = torch.empty((), dtype=dtype).element_size()
        need = 2 * num_layers * num_blocks * num_kv_heads * block_size * head_dim * elem
        free = available_memory(device)
        if need > HEADROOM * free:
            raise CacheMemoryError(f"a paged KV cache of {num_tokens} positions x {num_layers} layers needs "
                                   f"{need / 2**30:.2f} GiB on {device}, but only {free / 2**30:.2f} GiB is free; "
                                   "keep fewer KV cache tokens (kv_cache_tokens, --kv-cache-tokens) or rows")
        shape = (num_layers, num_blocks, num_kv_heads, block_size, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # (L, NB, H, block, D)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size
        self.block_table = torch.zeros(batch_size, -(-max_seq_len // block_size), dtype=torch.long,
                                       device=device)  # (B, W): 0 = no block
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)  # (B,)
        self.pool = BlockPool(num_blocks)
        self._owned: list[list[int]] = [[] for _ in range(batch_size)]  # row -> its blocks, in slot order
        self._row0 = 0  # the first row of this cache in the owner's rows (a view's offset)
        self.evict: Callable[[int], None] | None = None  # frees cached blocks until n are free (a prefix cache)

    @property
    def batch_size(self) -> int:
        return self.block_table.shape[0]

    @property
    def max_seq_len(self) -> int:
        return self.block_table.shape[1] * self.block_size

    @property
    def num_blocks(self) -> int:
        """Blocks of the pool that rows can hold (the null block not counted)."""
        return len(self.pool.refs) - 1

    @property
    def blocks_free(self) -> int:
        return self.pool.free

    @property
    def blocks_in_use(self) -> int:
        return self.num_blocks - self.pool.free

    def blocks_needed(self, tokens: int) -> int:
        """Blocks a row of `tokens` slots holds."""
        return -(-tokens // self.block_size)

    def held(self, row: int) -> int:
        """Blocks `row` holds (shared ones included)."""
        return len(self._owned[self._row0 + row])

    def rows(self, row: int, count: int = 1) -> PagedKVCache:
        self._check_rows(row, count)
        view = object.__new__(PagedKVCache)
        view.k, view.v, view.block_size = self.k, self.v, self.block_size  # the pool and its bookkeeping, shared
        view.pool, view._owned, view.evict = self.pool, self._owned, self.evict
        view.block_table = self.block_table[row:row + count]  # (count, W)
        view.lengths = self.lengths[row:row + count]
        view._row0 = self._row0 + row
        return view

    def _where(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Pool block and position of each slot (B, T) of the rows: (B, T) each (block 0: none)."""
        return self.block_table.gather(1, slots // self.block_size), slots % self.block_size

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
              uniform: bool = False) -> None:
        paged_write(self.k, self.v, layer, k, v, slots, self.block_table)

    def layer_kv(self, layer: int, num_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of slots [0, num_keys) of every row of `layer`, gathered through the
        table: (B, H, S, D) each (copies)."""
        return paged_kv(self.k, self.v, layer, self.block_table, num_keys)

    def compact(self, keep: torch.Tensor, start: torch.Tensor, count: torch.Tensor) -> None:
        n = keep.shape[1]
        if n:
            dst = start[:, None] + torch.arange(n, device=keep.device)  # (B, N)
            valid = torch.arange(n, device=keep.device)[None, :] < count[:, None]  # (B, N)
            src_b, src_p = self._where(keep)  # (B, N)
            dst_b, dst_p = self._where(dst)
            moved = valid & (dst_b != 0)
            src_b, src_p, dst_b, dst_p = src_b[moved], src_p[moved], dst_b[moved], dst_p[moved]  # (M,)
            # gather first, then scatter: source and destination ranges may overlap
            k_sel = self.k[:, src_b, :, src_p]  # (M, L, H, D)
            v_sel = self.v[:, src_b, :, src_p]
            self.k[:, dst_b, :, dst_p] = k_sel
            self.v[:, dst_b, :, dst_p] = v_sel
        self.lengths.copy_(start + count)

    def _row_where(self, row: int, lo: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Pool block and position of slots [lo, lo + n) of `row`: (n,) each."""
        slots = torch.arange(lo, lo + n, device=self.block_table.device)
        return self.block_table[row].gather(0, slots // self.block_size), slots % self.block_size

    def read_row(self, row: int, lo: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        b, p = self._row_where(row, lo, n)
        # (n, L, H, D) -> (L, H, n, D)
        return self.k[:, b, :, p].permute(1, 2, 0, 3), self.v[:, b, :, p].permute(1, 2, 0, 3)

    def write_row(self, row: int, lo: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v (L, H, n, D) at slots [lo, lo + n) of `row`, taking blocks for them if needed."""
        n = k.shape[2]
        self.reserve(row, lo + n)
        b, p = self._row_where(row, lo, n)
        self.k[:, b, :, p] = k.permute(2, 0, 1, 3)  # (L, H, n, D) -> (n, L, H, D)
        self.v[:, b, :, p] = v.permute(2, 0, 1, 3)

    def reserve(self, row: int, upto: int) -> None:
        """Give `row` blocks for its slots [0, upto) (CacheMemoryError when the pool has too few)."""
        owned = self._owned[self._row0 + row]
        need = self.blocks_needed(min(upto, self.max_seq_len))
        if need <= len(owned):
            return
        if need - len(owned) > self.pool.free and self.evict is not None:
            self.evict(need - len(owned))
        if need - len(owned) > self.pool.free:
            raise CacheMemoryError(f"row {row} needs {need - len(owned)} more KV blocks and {self.pool.free} are "
                                   "free; start the engine with more KV cache tokens (--kv-cache-tokens)")
        new = [self.pool.take() for _ in range(need - len(owned))]
        self.block_table[row, len(owned):need] = torch.tensor(new, device=self.block_table.device)
        owned.extend(new)

    def adopt(self, row: int, blocks: list[int]) -> None:
        """Row `row` (holding no blocks) starts with the full `blocks` of the pool, by reference."""
        owned = self._owned[self._row0 + row]
        if owned:
            raise ValueError(f"row {row} already holds blocks: blocks are adopted into an empty row")
        for b in blocks:
            self.pool.retain(b)
        owned.extend(blocks)
        if blocks:
            self.block_table[row, :len(blocks)] = torch.tensor(blocks, device=self.block_table.device)

    def free_row(self, row: int, zero: bool = False) -> None:
        """Empty `row` and give its blocks back; `zero`: zero those nobody else holds (see KVCache)."""
        owned = self._owned[self._row0 + row]
        freed = [b for b in owned if self.pool.drop(b)]
        if zero and freed:
            ids = torch.tensor(freed, device=self.k.device)
            self.k[:, ids] = 0
            self.v[:, ids] = 0
        owned.clear()
        self.block_table[row] = 0
        self.lengths[row] = 0

    def share(self, src: int, dst: int, n: int) -> None:
        """Row `dst` (holding no blocks) starts with slots [0, n) of row `src`: its full blocks by
        reference, the last partial one by copy."""
        full = n // self.block_size
        self.adopt(dst, self._owned[self._row0 + src][:full])
        rest = n - full * self.block_size
        if rest:
            k, v = self.read_row(src, full * self.block_size, rest)
            self.write_row(dst, full * self.block_size, k, v)
