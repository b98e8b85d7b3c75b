"""Penalties on recently seen tokens (mlx-lm's repetition, presence and frequency penalties), exact under
speculation.

A penalty reads the last `size` tokens of the sequence that a row of logits continues (the prompt included, as
mlx-lm's logits processors read it). In plain decoding that is the sequence so far. In a verified tree every node
continues its own path: a node at depth d continues the sequence so far (whose last token is the tree's root)
followed by the d drafted tokens from the root's child down to the node. So each node's row is penalized by the
window of its own path, and acceptance compares, node by node, what AR decoding would have decided after that very
path: the output is AR's output with the same penalties.

The tokens before a step are given as `recent`: the last `size` tokens or more of the sequence so far, an int32
array with -1 in front where the sequence is shorter (`window`, `slide`).
"""

from __future__ import annotations

import mlx.core as mx

from mlx_redrafter.tree import PackedTree


def window(tokens: list[int], size: int) -> mx.array:
    """(size,) int32: the last `size` tokens, -1 in front where there are fewer."""
    tail = tokens[-size:] if size else []
    return mx.array([-1] * (size - len(tail)) + list(tail), dtype=mx.int32)


def slide(recent: mx.array, token: mx.array) -> mx.array:
    """`recent` (R,) after the sequence grew by `token` (1,) (lazy)."""
    return mx.concatenate([recent[1:], token.astype(mx.int32)])


def _window_entries(recent: mx.array, size: int, tree: PackedTree | None) -> tuple[mx.array, mx.array]:
    """The tokens each row's window may hold and whether each is in it: ids (rows, K) int32 and weights (rows, K)
    float32 (1 in the window, 0 not). Without a tree, one row: the sequence so far (`recent` holds at least its
    last `size` tokens). With a packed tree whose root is the sequence's last token, one row per node: the
    sequence so far, then the node's path below the root (see the module docstring) (lazy)."""
    hist = recent[-size:]
    seen = (hist >= 0).astype(mx.float32)
    ids = mx.maximum(hist, 0)
    if tree is None:
        return ids[None], seen[None]
    P, depth = tree.size, tree.depth
    # A node at depth d keeps the sequence's last size - d tokens and its own last min(d, size) path tokens.
    keep_hist = (mx.arange(size)[None, :] >= depth[:, None]) * seen[None, :]  # (P, size)
    on_path = tree.mask & (depth[None, :] >= 1) & (depth[None, :] > depth[:, None] - size)  # (P, P)
    ids = mx.concatenate([mx.broadcast_to(ids[None], (P, size)),
                          mx.broadcast_to(tree.tokens.astype(mx.int32)[None], (P, P))], axis=1)
    return ids, mx.concatenate([keep_hist, on_path.astype(mx.float32)], axis=1)


def penalize(logits: mx.array, penalties: tuple[tuple[str, float, int], ...], recent: mx.array,
             tree: PackedTree | None = None) -> mx.array:
    """(rows, V) float32 logits with each penalty (kind, penalty, context size; in order) applied to the tokens of
    each row's window (`_window_entries`): repetition divides a positive logit by the penalty and multiplies a
    negative one, presence subtracts it once, frequency once per occurrence. Only the window's tokens are read and
    written (lazy)."""
    x, windows = logits, {}
    for kind, penalty, size in penalties:
        if size not in windows:  # penalties of one window size share its entries and counts
            ids, weights = _window_entries(recent, size, tree)
            windows[size] = ids, ((ids[:, :, None] == ids[:, None, :]) * weights[:, None, :]).sum(axis=-1)
        ids, times = windows[size]  # times: occurrences in the window of each entry's token
        value = mx.take_along_axis(x, ids, axis=-1)
        if kind == "repetition":
            new = mx.where(value < 0, value * penalty, value / penalty)
        elif kind == "presence":
            new = value - penalty
        else:
            new = value - penalty * times
        # every copy of a token in a row writes the same value; a token outside the window keeps its logit
        x = mx.put_along_axis(x, ids, mx.where(times > 0, new, value), axis=-1)
    return x
