"""Dynamic tree attention: deduplicate shared candidate prefixes with tensor ops, pack, mask, unpack.

Candidates (n, L) all start with the same token (the target's next token). A candidate shorter than L is padded
with PAD after its end; PAD slots are never packed or verified. A candidate ends at its first PAD: every slot after
it is PAD too, by construction in `pack` (a stray PAD-valued id inside a candidate cannot splice the tokens after it
onto a shorter path). Token (i, k) is kept iff it is not PAD and no
lower-index candidate shares cands[i, :k+1]. Kept tokens are packed in (candidate, depth) order, which is
topological: every token's ancestors come before it. The `unpacker` (n, L) maps each candidate slot to its
packed index (0 for PAD slots, which acceptance never reaches).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

PAD = -1  # candidate slot past the candidate's end


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
    parent: mx.array  # (P,) packed index of each token's parent (-1 for the root, packed index 0)
    unpacker: mx.array  # (n, L) packed index of every candidate slot
    size: int  # P


def pack(cands: mx.array) -> PackedTree:
    """Pack one sequence's candidates (n, L). Evaluates (one host sync) to learn the packed size P."""
    W, L = cands.shape
    real = mx.cumprod((cands != PAD).astype(mx.int32), axis=1).astype(mx.bool_)  # before the first PAD
    cands = mx.where(real, cands, PAD)
    parent = prefix_of(cands)  # (W, L)
    keep = ((parent == mx.arange(W)[:, None]) & real).reshape(-1)  # (W*L,)
    packed_index = (mx.cumsum(keep.astype(mx.int32)) - 1).reshape(W, L)
    unpacker = mx.take_along_axis(packed_index, parent, axis=0)  # unpacker[i,k] = packed_index[parent[i,k], k]
    unpacker = mx.where(real, unpacker, 0)
    n_kept = keep.sum()
    flat = mx.arange(W * L)
    mx.eval(cands, unpacker, n_kept, keep)
    P = n_kept.item()
    order = mx.argsort(mx.where(keep, flat, W * L + flat))[:P].astype(mx.int32)  # flat slots of kept tokens, in order
    depth = order % L
    ancestors = unpacker[order // L]  # (P, L): packed index of each depth along the token's candidate
    valid = mx.arange(L)[None, :] <= depth[:, None]
    mask = ((ancestors[:, :, None] == mx.arange(P)[None, None, :]) & valid[:, :, None]).any(axis=1)
    parent = mx.where(depth > 0, mx.take_along_axis(ancestors, mx.maximum(depth - 1, 0)[:, None], axis=1)[:, 0], -1)
    return PackedTree(tokens=cands.reshape(-1)[order], depth=depth, mask=mask, parent=parent, unpacker=unpacker,
                      size=P)


def chain(cands: mx.array, size: int) -> PackedTree:
    """The packed tree of one candidate (1, L) whose first `size` slots are real (PAD after them): the candidate
    itself, as `pack` would give it, without a host sync."""
    L = cands.shape[1]
    idx = mx.arange(size, dtype=mx.int32)
    slots = mx.arange(L, dtype=mx.int32)
    return PackedTree(tokens=cands[0, :size], depth=idx, mask=idx[:, None] >= idx[None, :], parent=idx - 1,
                      unpacker=mx.where(slots < size, slots, 0)[None], size=size)


def verify_mask(tree_mask: mx.array, context_len: int) -> mx.array:
    """(1, 1, P, context_len + P) bool: every packed token sees the whole committed context."""
    P = tree_mask.shape[0]
    return mx.concatenate([mx.ones((P, context_len), dtype=mx.bool_), tree_mask], axis=1)[None, None]
