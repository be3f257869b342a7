"""Static KV cache: preallocated buffers, a length per row, rollback and in-place compaction.

Layout: `k` and `v` are (L, B, H_kv, S_max, D). Row b holds its keys and values in slots
[0, lengths[b]); a forward pass writes its T new tokens at slots lengths[b] .. lengths[b]+T-1
and advances the lengths. Rejected draft tokens are dropped by lowering a length (no copy);
a tree's accepted path is moved to contiguous slots with `compact` (one gather per call).

`runtime.paged_cache.PagedKVCache` keeps the same slots (positions of a row) in blocks of a shared
pool through a block table; everything that reads or writes a cache goes through the methods
below (`write`, `layer_kv`, `rows`, `read_row` / `write_row`, `share`), so both layouts serve every
caller. `block_table` is None here.
"""

from __future__ import annotations

import psutil
import torch

from runtime.errors import CacheMemoryError, ContextLengthError

HEADROOM = 0.9  # fraction of the free memory a cache may take


def available_memory(device: torch.device) -> int:
    """Free bytes on `device` (host memory for the CPU)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return int(psutil.virtual_memory().available)


def cache_bytes(num_layers: int, batch_size: int, num_kv_heads: int, max_seq_len: int,
                head_dim: int, dtype: torch.dtype) -> int:
    """Bytes that the K and V buffers of a cache of this shape take."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * batch_size * num_kv_heads * max_seq_len * head_dim * elem


def write_slots(k_buf: torch.Tensor, v_buf: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor,
                slots: torch.Tensor, uniform: bool) -> None:
    """Store k, v (B, H, T, D) into layer `layer` of the buffers (L, B, H, S, D) at `slots` (B, T)."""
    if uniform:
        k_buf[layer].index_copy_(2, slots[0], k)
        v_buf[layer].index_copy_(2, slots[0], v)
        return
    rows = torch.arange(k.shape[0], device=slots.device)[:, None]  # (B, 1)
    k_buf[layer][rows, :, slots] = k.transpose(1, 2)  # (B, T, H, D) into (B, H, S, D)
    v_buf[layer][rows, :, slots] = v.transpose(1, 2)


class KVCache:
    """Preallocated keys and values of every layer, with a per-row length."""

    def __init__(self, num_layers: int, batch_size: int, num_kv_heads: int, max_seq_len: int,
                 head_dim: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        device = torch.device(device)
        need = cache_bytes(num_layers, batch_size, num_kv_heads, max_seq_len, head_dim, dtype)
        free = available_memory(device)
        if need > HEADROOM * free:
            raise CacheMemoryError(
                f"a KV cache for batch {batch_size} x {max_seq_len} positions x {num_layers} layers "
                f"needs {need / 2**30:.2f} GiB on {device}, but only {free / 2**30:.2f} GiB is free; "
                "lower the batch size, max_new_tokens or the prompt length")
        shape = (num_layers, batch_size, num_kv_heads, max_seq_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # (L, B, H, S_max, D)
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # (L, B, H, S_max, D)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)  # (B,)

    block_table: torch.Tensor | None = None  # (B, blocks per row) for a paged cache

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    @property
    def max_seq_len(self) -> int:
        return self.k.shape[3]

    def slots(self, num_new: int) -> torch.Tensor:
        """Slots the next `num_new` tokens of each row go to: (B, T)."""
        return self.lengths[:, None] + torch.arange(num_new, device=self.lengths.device)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
              uniform: bool = False) -> None:
        """Store k, v of shape (B, H, T, D) for `layer` at `slots` (B, T); `uniform` says that
        every row writes to the same slots (one index_copy_ instead of a scatter)."""
        write_slots(self.k, self.v, layer, k, v, slots, uniform)

    def layer_kv(self, layer: int, num_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of slots [0, num_keys) of every row of `layer`: (B, H, S, D) each (views)."""
        return self.k[layer][:, :, :num_keys], self.v[layer][:, :, :num_keys]

    def rows(self, row: int, count: int = 1) -> KVCache:
        """Rows [row, row + count) as a cache of their own: views of the buffers and lengths, so a
        forward through it (a newcomer's prefill) writes into this cache and allocates nothing."""
        self._check_rows(row, count)
        view = object.__new__(type(self))
        view.k, view.v = self.k[:, row:row + count], self.v[:, row:row + count]  # (L, count, H, S_max, D)
        view.lengths = self.lengths[row:row + count]  # (count,)
        return view

    def _check_rows(self, row: int, count: int) -> None:
        if not (0 <= row and count >= 1 and row + count <= self.batch_size):
            raise ValueError(f"rows [{row}, {row + count}) are outside the cache's {self.batch_size} rows")

    def read_row(self, row: int, lo: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of slots [lo, lo + n) of `row` in every layer: (L, H, n, D) each."""
        return self.k[:, row, :, lo:lo + n], self.v[:, row, :, lo:lo + n]

    def write_row(self, row: int, lo: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v (L, H, n, D) at slots [lo, lo + n) of `row` in every layer."""
        n = k.shape[2]
        self.k[:, row, :, lo:lo + n] = k
        self.v[:, row, :, lo:lo + n] = v

    def share(self, src: int, dst: int, n: int) -> None:
        """Give row `dst` the keys and values of slots [0, n) of row `src` (a common prefix)."""
        self.k[:, dst, :, :n] = self.k[:, src, :, :n]
        self.v[:, dst, :, :n] = self.v[:, src, :, :n]

    def reserve(self, row: int, upto: int) -> None:
        """Make slots [0, upto) of `row` writable: nothing to do here (a paged cache allocates blocks)."""

    def free_row(self, row: int, zero: bool = False) -> None:
        """Empty `row` (length 0); `zero`: also zero its keys and values (what a fault left there, NaN
        keys say, would otherwise reach the row's next request: a masked slot gets weight 0, and
        0 x NaN is NaN)."""
        self.lengths[row] = 0
        if zero:
            self.k[:, row].zero_()
            self.v[:, row].zero_()

    def check_room(self, num_new: int) -> None:
        """Raise if some row cannot take `num_new` more tokens."""
        longest = int(self.lengths.max()) + num_new
        if longest > self.max_seq_len:
            raise ContextLengthError(f"the KV cache holds {self.max_seq_len} positions per row; "
                                     f"{longest} were asked for")

    def rollback(self, lengths: torch.Tensor) -> None:
        """Drop every slot at or after `lengths` (B,): a rejection costs no copy."""
        if bool((lengths > self.lengths).any()):
            raise ValueError("rollback can only shorten rows")
        self.lengths.copy_(lengths)

    def compact(self, keep: torch.Tensor, start: torch.Tensor, count: torch.Tensor) -> None:
        """Move the slots `keep` (B, N) of each row to start[b] .. start[b]+count[b]-1, in place.

        Used after tree verification: `keep[b, :count[b]]` are the slots of the accepted path
        (in order), `start[b]` the row's length before the tree. Entries past count[b] are
        ignored. The new length of row b is start[b] + count[b].
        """
        n = keep.shape[1]
        if n:
            rows = torch.arange(keep.shape[0], device=keep.device)[:, None]  # (B, 1)
            dst = start[:, None] + torch.arange(n, device=keep.device)  # (B, N)
            valid = torch.arange(n, device=keep.device)[None, :] < count[:, None]  # (B, N)
            src = torch.where(valid, keep, dst)  # invalid entries copy onto themselves
            # gather first, then scatter: source and destination ranges may overlap
            k_sel = self.k[:, rows, :, src]  # (B, N, L, H, D)
            v_sel = self.v[:, rows, :, src]
            self.k[:, rows, :, dst] = k_sel
            self.v[:, rows, :, dst] = v_sel
        self.lengths.copy_(start + count)
