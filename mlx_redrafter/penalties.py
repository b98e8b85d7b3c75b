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


def counts(recent: mx.array, size: int, vocab: int, tree: PackedTree | None = None) -> mx.array:
    """(rows, vocab) float32: how often each token occurs in the last `size` tokens each row continues. Without a
    tree, one row: the sequence so far (`recent` holds at least its last `size` tokens). With a packed tree whose
    root is the sequence's last token, one row per node: the sequence so far, then the node's path below the root
    (see the module docstring) (lazy)."""
    hist = recent[-size:]
    seen = (hist >= 0).astype(mx.float32)
    ids = mx.maximum(hist, 0)
    if tree is None:
        return mx.zeros((1, vocab), mx.float32).at[mx.zeros_like(ids), ids].add(seen)
    P, depth = tree.size, tree.depth
    # A node at depth d keeps the sequence's last size - d tokens and its own last min(d, size) path tokens.
    keep_hist = (mx.arange(size)[None, :] >= depth[:, None]) * seen[None, :]  # (P, size)
    on_path = tree.mask & (depth[None, :] >= 1) & (depth[None, :] > depth[:, None] - size)  # (P, P)
    rows = mx.concatenate([mx.repeat(mx.arange(P), size), mx.repeat(mx.arange(P), P)])
    cols = mx.concatenate([mx.tile(ids, P), mx.tile(tree.tokens.astype(mx.int32), P)])
    weights = mx.concatenate([keep_hist.reshape(-1), on_path.reshape(-1).astype(mx.float32)])
    return mx.zeros((P, vocab), mx.float32).at[rows, cols].add(weights)
