"""A KV cache for a batch of sequences of different lengths.

Every row shares the physical layout of `KVCache` (keys/values (B, n_kv_heads, capacity, head_dim); a forward
writes its N new tokens at [offset, offset + N) for every row), but a row's committed entries are only the
slots of [0, offset) marked in `valid`: the others are holes, masked out of every attention. Holes appear where
a row accepted fewer tokens than the step's longest accepted row (the offset advances by the most any row
committed) and where a row joined shorter than the others. Each row's entries carry their own RoPE positions
(`lengths`), so holes change nothing but the masked keys a query skips.

Rows that joined later, or after a long row, start far into the cache: a forward attends each block of rows from
the first slot any of them uses (`key_windows`) instead of every row from slot 0.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlx_redrafter.cache import KVCache

WINDOW_ALIGN = 16  # a key window starts at a multiple of this many slots (see `key_windows`)
WINDOW_COST = 1024  # what one more block of rows costs (its dispatches), in rows x keys of attention


class RowsCache(KVCache):
    def __init__(self, num_layers: int, capacity: int, step: int = 256):
        super().__init__(num_layers, capacity, step)
        self.valid = np.zeros((0, capacity), dtype=bool)  # (B, >= offset) committed slots per row
        self.lengths: list[int] = []  # committed tokens per row (the next RoPE position)
        self._changes = 0  # bumped whenever `valid` or `offset` change (keys `key_windows`' memo)
        self._windows: tuple[tuple[int, int], tuple[tuple[int, int, int], ...] | None] = ((-1, -1), None)

    @property
    def rows(self) -> int:
        return len(self.lengths)

    def context_mask(self) -> mx.array:
        """(B, offset) bool: the committed slots each row attends to."""
        return mx.array(self.valid[:, : self.offset])

    def key_windows(self) -> tuple[tuple[int, int, int], ...] | None:
        """Blocks of consecutive rows (first row, end row, first key slot) that cover every row, each block's first
        slot at or before the first committed slot of each of its rows: a forward whose mask lets a row see only
        its committed slots and the new tokens (`context_mask`) attends each block from its first slot on, with
        the same result. None where one block from slot 0 is best (see `plan_windows`)."""
        key = (self.offset, self._changes)
        if self._windows[0] != key:
            v = self.valid[:, : self.offset]
            firsts = np.where(v.any(axis=1), v.argmax(axis=1), self.offset) if self.offset else np.zeros(self.rows)
            self._windows = (key, plan_windows([int(f) for f in firsts], self.offset))
        return self._windows[1]

    def _room(self, end: int) -> None:
        if self.valid.shape[1] < end:
            size = max(end, 2 * self.valid.shape[1])
            self.valid = np.pad(self.valid, [(0, 0), (0, size - self.valid.shape[1])])

    def join(self, row: KVCache) -> int:
        """Append a sequence whose prompt `row` (a one-row cache) has prefilled; returns its row index (see
        `join_rows`)."""
        return self.join_rows(row, np.ones((1, row.offset), dtype=bool), [row.offset])[0]

    def join_rows(self, other: KVCache, valid: np.ndarray, lengths: list[int], room: int | None = None) -> list[int]:
        """Append the rows of `other` (a cache of several rows, e.g. a left-padded prefill): `valid` (rows,
        other.offset) marks each row's entries (the rest, padding and holes, stay masked) and `lengths` are its
        next RoPE positions. Returns their row indices.

        Their entries go to the end of the committed region, [offset - n, offset) for n = other.offset; when they
        are longer than that region, the region grows and the other rows get holes after their entries. No row is
        recomputed. `room`: the free slots kept after the committed region (default: the current width); the
        cache is laid anew one layer at a time (`relayout`)."""
        n = other.offset
        end = max(self.offset, n)
        width = end + room if room is not None else max(self.keys[0].shape[2] if self.keys[0] is not None
                                                        else self.capacity, end)

        def stacked(a: mx.array | None, b: mx.array) -> mx.array:
            b = mx.pad(b[:, :, :n], [(0, 0), (0, 0), (end - n, width - end), (0, 0)])
            return b if a is None else mx.concatenate([_fit(a, width), b])

        self.relayout(stacked, other)
        self.capacity = width
        self._room(width)
        place = np.zeros((len(lengths), self.valid.shape[1]), dtype=bool)
        place[:, end - n : end] = valid[:, :n]
        self.valid = np.concatenate([self.valid, place])
        self._changes += 1
        first = self.rows
        self.lengths += [int(x) for x in lengths]
        self.offset = end
        return list(range(first, self.rows))

    def select(self, rows: list[int], share: float = 0.25) -> None:
        """Keep only these rows, in this order (e.g. to drop finished sequences), laid anew one layer at a time,
        and drop the leading slots none of them uses (`trim`, with `share`)."""
        if rows == list(range(self.rows)):
            return
        if rows:
            idx = mx.array(rows, dtype=mx.int32)
            self.relayout(lambda a: a[idx])
        else:
            self.keys = [None] * self.num_layers
            self.values = [None] * self.num_layers
            self.offset = 0
        self.valid = self.valid[rows]
        self._changes += 1
        self.lengths = [self.lengths[r] for r in rows]
        self.trim(share=share)

    def trim(self, least: int = 64, share: float = 0.25) -> None:
        """Drop the leading slots no row uses any more (left by rows that finished), when there are at least
        `least` of them and `share` of the committed region: attention and masks then cover only live rows'
        spans, at the price of one copy of the cache."""
        used = self.valid[:, : self.offset].any(axis=0)
        first = int(used.argmax()) if used.any() else self.offset
        if first < max(least, int(self.offset * share)):
            return
        for i in range(self.num_layers):
            if self.keys[i] is not None:
                self.keys[i], self.values[i] = self.keys[i][:, :, first:], self.values[i][:, :, first:]
        self.valid = self.valid[:, first:]
        self._changes += 1
        self.offset -= first
        self.capacity = max(self.capacity - first, 1)

    def commit_rows(self, paths: mx.array | None, counts: list[int]) -> None:
        """Commit each row's accepted path: `paths` (B, L) scratch indices (evaluated; None: in place), of which
        row r keeps the first counts[r]; the offset advances by the largest count, the shorter rows leaving
        holes."""
        longest = max(counts, default=0)
        if longest == 0:
            return
        if paths is not None and any(paths[r, :c].tolist() != list(range(c)) for r, c in enumerate(counts)):
            lo, hi = self.offset, self.offset + paths.shape[1]
            src = (self.offset + paths)[:, None, :, None]
            self._place(lo, hi, [(mx.take_along_axis(self.keys[i], src, axis=2),
                                  mx.take_along_axis(self.values[i], src, axis=2)) for i in range(self.num_layers)])
        self._room(self.offset + longest)
        for r, c in enumerate(counts):
            self.valid[r, self.offset : self.offset + c] = True
            self.lengths[r] += c
        self.offset += longest
        self._changes += 1

    def extract(self, row: int, n: int) -> KVCache:
        """A one-row `KVCache` holding the first n committed entries of a row, holes squeezed out."""
        slots = np.flatnonzero(self.valid[row, : self.offset])[:n]
        idx = mx.array(slots, dtype=mx.int32)
        out = KVCache(self.num_layers, max(n, 1))
        for i in range(self.num_layers):
            out.keys[i] = self.keys[i][row : row + 1][:, :, idx]
            out.values[i] = self.values[i][row : row + 1][:, :, idx]
        out.offset = n
        mx.eval(*out.state())
        return out


def plan_windows(firsts: list[int], end: int) -> tuple[tuple[int, int, int], ...] | None:
    """Key windows for rows whose committed slots start at `firsts` (end: none) in a cache of `end` committed
    slots: consecutive rows grouped to the fewest rows x keys of attention, each block costing `WINDOW_COST` more,
    each window starting at a multiple of `WINDOW_ALIGN` (our attention kernel then sums every key in the vector
    lane it would use over the whole cache: the same bits). None where one block from slot 0 is best."""
    runs: list[list[int]] = []  # [first slot (aligned), rows] of consecutive rows
    for f in firsts:
        f -= f % WINDOW_ALIGN
        if runs and runs[-1][0] == f:
            runs[-1][1] += 1
        else:
            runs.append([f, 1])
    m = len(runs)
    best = [0.0] + [float("inf")] * m  # best[j]: cost of the first j runs
    cut = [0] * (m + 1)
    for j in range(1, m + 1):
        lo, rows = end, 0
        for i in range(j, 0, -1):  # the last block: runs i-1 .. j-1
            lo, rows = min(lo, runs[i - 1][0]), rows + runs[i - 1][1]
            cost = best[i - 1] + rows * (end - lo) + WINDOW_COST
            if cost < best[j]:
                best[j], cut[j] = cost, i - 1
    blocks, j = [], m
    while j:
        i = cut[j]
        blocks.append((sum(r for _, r in runs[:i]), sum(r for _, r in runs[:j]), min(f for f, _ in runs[i:j])))
        j = i
    blocks.reverse()
    if not blocks or (len(blocks) == 1 and blocks[0][2] == 0):
        return None
    return tuple(blocks)


def _fit(a: mx.array, n: int) -> mx.array:
    """a (B, h, S, D) cut or zero-padded to n slots."""
    return a[:, :, :n] if a.shape[2] >= n else mx.pad(a, [(0, 0), (0, 0), (0, n - a.shape[2]), (0, 0)])
