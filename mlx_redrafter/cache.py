"""Pre-allocated KV cache with a committed region and a scratch region for packed candidates.

Layout per layer: keys/values (B, n_kv_heads, capacity, head_dim). Positions [0, offset) are committed
(exactly what autoregressive decoding would have built); a forward writes its new tokens at
[offset, offset + N) -- the scratch region -- and attends to [0, offset + N). `advance(n)` commits the
first n scratch entries as they are (prefill, AR steps); `commit(path, n)` commits the entries of an
accepted tree path, in order, and drops the rest; `truncate(n)` keeps only the first n committed entries.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx


class KVCache:
    def __init__(self, num_layers: int, capacity: int, step: int = 256):
        self.num_layers = num_layers
        self.capacity = capacity
        self.step = step
        self.offset = 0  # committed length
        self.keys: list[mx.array | None] = [None] * num_layers
        self.values: list[mx.array | None] = [None] * num_layers

    def _ensure(self, layer: int, k: mx.array, end: int) -> None:
        cur = self.keys[layer]
        if cur is not None and cur.shape[2] >= end:
            return
        B, h, _, D = k.shape
        size = max(self.capacity, ((end + self.step - 1) // self.step) * self.step)
        new_k = mx.zeros((B, h, size, D), dtype=k.dtype)
        new_v = mx.zeros((B, h, size, D), dtype=k.dtype)
        if cur is not None:
            new_k[:, :, : self.offset] = cur[:, :, : self.offset]
            new_v[:, :, : self.offset] = self.values[layer][:, :, : self.offset]
        self.keys[layer], self.values[layer] = new_k, new_v
        self.capacity = size

    def store(self, layer: int, k: mx.array, v: mx.array) -> int:
        """Store N new entries at [offset, offset+N); return offset+N, the entries a forward now attends."""
        end = self.offset + k.shape[2]
        self._ensure(layer, k, end)
        self.keys[layer][:, :, self.offset : end] = k
        self.values[layer][:, :, self.offset : end] = v
        return end

    def write(self, layer: int, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        """Store N new entries at [offset, offset+N); return the visible keys/values [0, offset+N)."""
        end = self.store(layer, k, v)
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def advance(self, n: int) -> None:
        """Commit the first n scratch entries in place."""
        self.offset += n

    def truncate(self, n: int) -> None:
        """Keep the first n committed entries; the rest become scratch (overwritten by the next forward)."""
        if not 0 <= n <= self.offset:
            raise ValueError(f"cannot truncate a cache of {self.offset} committed entries to {n}")
        self.offset = n

    def commit(self, path: mx.array, n: int) -> None:
        """Commit an accepted path: scratch indices `path` (L,) in order; the first n become committed.

        The whole path (fixed length L) is copied so shapes stay static; entries past n are scratch again.
        Nothing is copied when the first n entries are already in place (the path starts 0, 1, ..., n-1, as it
        does whenever the first candidate's run is kept); `path` must then be evaluated (it is read on the host).
        """
        if path[:n].tolist() == list(range(n)):
            self.offset += n
            return
        src = self.offset + path
        lo, hi = self.offset, self.offset + path.shape[0]
        self._place(lo, hi, [(self.keys[i][:, :, src], self.values[i][:, :, src]) for i in range(self.num_layers)])
        self.offset += n

    def _place(self, lo: int, hi: int, moved: list[tuple[mx.array, mx.array]]) -> None:
        """Write gathered (keys, values) per layer to slots lo:hi. The gather is evaluated first: a write that
        read the cache it writes would copy the whole cache instead of updating it in place."""
        mx.eval(moved)
        for i, (k, v) in enumerate(moved):
            self.keys[i][:, :, lo:hi] = k
            self.values[i][:, :, lo:hi] = v

    def select(self, rows: mx.array) -> None:
        """Keep only these batch rows (in this order), e.g. to drop finished sequences from a batch."""
        for i in range(self.num_layers):
            if self.keys[i] is not None:
                self.keys[i], self.values[i] = self.keys[i][rows], self.values[i][rows]

    def relayout(self, fn: Callable[..., mx.array], other: KVCache | None = None) -> None:
        """Replace every layer's keys and values a by fn(a), or fn(a, b) with `other`'s b (a is None in a layer
        this cache has not written), one layer at a time: the cache is never held twice (a data engine's 64-row
        cache holds several GB), and the old layouts are given back."""
        for i in range(self.num_layers):
            if other is None:
                if self.keys[i] is None:
                    continue
                self.keys[i], self.values[i] = fn(self.keys[i]), fn(self.values[i])
            else:
                self.keys[i], self.values[i] = fn(self.keys[i], other.keys[i]), fn(self.values[i], other.values[i])
            mx.eval(self.keys[i], self.values[i])
        if self.keys[0] is not None:
            self.capacity = self.keys[0].shape[2]
        mx.clear_cache()

    def copy(self) -> KVCache:
        """An independent cache with the same contents (e.g. to decode several continuations of one prefix)."""
        other = KVCache(self.num_layers, self.capacity, self.step)
        other.offset = self.offset
        other.keys = [None if a is None else mx.array(a) for a in self.keys]
        other.values = [None if a is None else mx.array(a) for a in self.values]
        return other

    def state(self) -> list[mx.array]:
        """All cache arrays (for mx.eval)."""
        return [a for a in self.keys + self.values if a is not None]

    def key_windows(self) -> tuple[tuple[int, int, int], ...] | None:
        """Blocks of rows (first row, end row, first key slot) a forward may attend from their first slot on; None:
        every row from slot 0 (here every row's entries start there; `RowsCache` says otherwise)."""
        return None

    def committed(self, layer: int) -> tuple[mx.array, mx.array]:
        """Committed keys/values of one layer, (B, n_kv, offset, D)."""
        return self.keys[layer][:, :, : self.offset], self.values[layer][:, :, : self.offset]
