"""Dynamic tree attention: deduplicate shared beam prefixes with tensor ops, pack, mask, unpack.

For beams (W, L) that all start with the same token, token (i, k) is kept iff no lower-index beam
shares beams[i, :k+1]. Kept tokens are packed in (beam, depth) order, which is topological: every
token's ancestors come before it. The `unpacker` (W, L) maps each beam slot to its packed index.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


def prefix_of(beams: mx.array) -> mx.array:
    """(..., W, L) -> (..., W, L): smallest beam j with beams[j, :k+1] == beams[i, :k+1]."""
    L = beams.shape[-1]
    match = beams[..., :, None, :] == beams[..., None, :, :]  # (..., W_i, W_j, L)
    prefix_eq = mx.cumsum(match.astype(mx.int32), axis=-1) == mx.arange(1, L + 1)
    return mx.argmax(prefix_eq, axis=-2).astype(mx.int32)  # first True over j


@dataclass
class PackedTree:
    tokens: mx.array  # (P,) packed token ids
    depth: mx.array  # (P,) depth k of each packed token (RoPE position = context length + depth)
    mask: mx.array  # (P, P) bool: packed token a may attend to b (its ancestors and itself)
    unpacker: mx.array  # (W, L) packed index of every beam slot
    size: int  # P


def pack(beams: mx.array) -> PackedTree:
    """Pack one sequence's beams (W, L). Evaluates (one host sync) to learn the packed size P."""
    W, L = beams.shape
    parent = prefix_of(beams)  # (W, L)
    keep = (parent == mx.arange(W)[:, None]).reshape(-1)  # (W*L,)
    packed_index = (mx.cumsum(keep.astype(mx.int32)) - 1).reshape(W, L)
    unpacker = mx.take_along_axis(packed_index, parent, axis=0)  # unpacker[i,k] = packed_index[parent[i,k], k]
    n_kept = keep.sum()
    flat = mx.arange(W * L)
    mx.eval(beams, unpacker, n_kept, keep)
    P = n_kept.item()
    order = mx.argsort(mx.where(keep, flat, W * L + flat))[:P]  # flat slots of the kept tokens, in order
    depth = order % L
    ancestors = unpacker[order // L]  # (P, L): packed index of each depth along the token's beam
    valid = mx.arange(L)[None, :] <= depth[:, None]
    mask = ((ancestors[:, :, None] == mx.arange(P)[None, None, :]) & valid[:, :, None]).any(axis=1)
    return PackedTree(tokens=beams.reshape(-1)[order], depth=depth, mask=mask, unpacker=unpacker, size=P)


def verify_mask(tree_mask: mx.array, context_len: int) -> mx.array:
    """(1, 1, P, context_len + P) bool: every packed token sees the whole committed context."""
    P = tree_mask.shape[0]
    return mx.concatenate([mx.ones((P, context_len), dtype=mx.bool_), tree_mask], axis=1)[None, None]
