"""Acceptance: which drafted tokens the target keeps, and the token it decides after them.

Greedy: the longest prefix of any candidate that the target itself would have produced (ties: lowest index).
Exact sampling (temperature > 0): rejection sampling without replacement over the packed tree; the emitted
tokens are distributed exactly as AR samples of the target, whatever the drafts were. Typical acceptance
(Medusa): a draft is kept while its probability exceeds min(eps, delta * exp(-entropy)); faster, not exact.
All three run in MLX without host syncs; the caller evaluates the result once.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from mlx_redrafter.sampling import Sampling, sample
from mlx_redrafter.tree import PackedTree


@dataclass
class Accepted:
    """The outcome of one verification (lazy arrays)."""

    n: mx.array  # () accepted drafts
    path: mx.array  # (>= n+1,) packed indices of the root and the accepted drafts, in order
    next_token: mx.array  # (1,) the target's token after them (the next step's first token)
    stop: mx.array  # () packed index of the last accepted token (its hidden state conditions the next draft)
    matched: mx.array  # (n_candidates,) accepted drafts along each candidate (for per-source statistics)


def accept_greedy(cands: mx.array, tree: PackedTree, logits: mx.array) -> Accepted:
    """cands (n, L), the packed tree and its logits (P, V): the longest candidate prefix equal to the argmax."""
    top = mx.argmax(logits, axis=-1).astype(mx.int32)  # (P,)
    target_next = top[tree.unpacker]  # (n, L): the target's choice after each candidate slot
    ok = (cands[:, 1:] == target_next[:, :-1]).astype(mx.int32)  # PAD never matches
    runs = mx.cumprod(ok, axis=1).sum(axis=1)  # (n,)
    best = mx.argmax(runs)  # first maximum: ties go to the lowest index
    n = runs[best]
    path = tree.unpacker[best]
    stop = path[n]
    return Accepted(n=n, path=path, next_token=top[stop][None], stop=stop, matched=runs)


def _walk(tree: PackedTree, cands: mx.array, accepted: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """From per-node acceptance (P,) bool: (stop node, n, path, runs per candidate) of the accepted chain."""
    accepted = accepted | (tree.parent < 0)  # the root is decided already
    on_path = ~(tree.mask & ~accepted[None, :]).any(axis=1)  # every ancestor (and itself) accepted
    stop = mx.argmax(mx.where(on_path, tree.depth, -1))  # deepest node of the chain (one per depth)
    n = tree.depth[stop]
    P = tree.size
    path = mx.argsort(mx.where(on_path, tree.depth, P + tree.depth))[: cands.shape[1]]
    slot_ok = accepted[tree.unpacker[:, 1:]] & (cands[:, 1:] >= 0)
    runs = mx.cumprod(slot_ok.astype(mx.int32), axis=1).sum(axis=1)
    return stop, n, path, runs


def _child_probs(tree: PackedTree, node_p: mx.array) -> mx.array:
    """(P,) probability of each packed token under its parent's distribution (root: 1)."""
    par = mx.maximum(tree.parent, 0)
    return mx.where(tree.parent >= 0, node_p[par, tree.tokens], 1.0)


def accept_exact(cands: mx.array, tree: PackedTree, node_p: mx.array, key: mx.array) -> Accepted:
    """Rejection sampling without replacement over the tree. node_p (P, V): target distribution after each node.

    At a node with distribution p, its children (distinct tokens, in packed order) are tried in turn: child x
    is accepted with probability p(x); on rejection p(x) is set to 0 and p renormalised before the next child.
    If every child is rejected (or the node is a leaf), the next token is sampled from what remains of p.
    """
    k_u, k_s = mx.random.split(key)
    P = tree.size
    pc = _child_probs(tree, node_p)
    idx = mx.arange(P)
    sib_before = (tree.parent[:, None] == tree.parent[None, :]) & (idx[None, :] < idx[:, None])  # (a, b): b first
    mass_before = (sib_before * pc[None, :]).sum(axis=1)
    u = mx.random.uniform(shape=(P,), key=k_u)
    cond = u * (1.0 - mass_before) < pc  # U < p(x) / (1 - mass of rejected siblings)
    accepted = cond & ~(sib_before & cond[None, :]).any(axis=1)  # the first sibling that passes
    stop, n, path, runs = _walk(tree, cands, accepted)
    children = (tree.parent == stop) & (tree.parent >= 0)  # all tried and rejected at the stop node
    p = node_p[stop]
    tried = mx.zeros(p.shape, dtype=mx.float32).at[tree.tokens].add(children.astype(mx.float32)) > 0
    rest = mx.where(tried, 0.0, p)
    rest = mx.where(rest.sum() > 0, rest, p)  # rounding guard: the residual of a fully covered p
    return Accepted(n=n, path=path, next_token=sample(rest / rest.sum(), k_s)[None], stop=stop, matched=runs)


def accept_typical(cands: mx.array, tree: PackedTree, node_p: mx.array, s: Sampling, key: mx.array) -> Accepted:
    """Medusa's typical acceptance: keep a draft x while p(x) > min(eps, delta * exp(-H(p))); the longest
    accepted candidate prefix wins; the next token is sampled from the target there. Not distribution-exact."""
    entropy = -(node_p * mx.log(mx.maximum(node_p, 1e-30))).sum(axis=-1)  # (P,)
    threshold = mx.minimum(s.typical_eps, s.typical_delta * mx.exp(-entropy))
    pc = _child_probs(tree, node_p)
    par = mx.maximum(tree.parent, 0)
    ok = pc > threshold[par]
    slot_ok = ok[tree.unpacker[:, 1:]] & (cands[:, 1:] >= 0)
    runs = mx.cumprod(slot_ok.astype(mx.int32), axis=1).sum(axis=1)
    best = mx.argmax(runs)
    n = runs[best]
    path = tree.unpacker[best]
    stop = path[n]
    return Accepted(n=n, path=path, next_token=sample(node_p[stop], key)[None], stop=stop, matched=runs)


def accept(cands: mx.array, tree: PackedTree, logits: mx.array, s: Sampling, key: mx.array | None) -> Accepted:
    """Dispatch on the sampling settings (greedy / exact / typical); `logits` (P, V) as `sampling.adjust` gives them
    for the tree's nodes."""
    from mlx_redrafter.sampling import probs

    if s.greedy:
        return accept_greedy(cands, tree, logits)
    node_p = probs(logits, s)
    if callable(s.accept):
        return s.accept(cands, tree, node_p, key)
    if s.accept == "typical":
        return accept_typical(cands, tree, node_p, s, key)
    return accept_exact(cands, tree, node_p, key)


def truncate_at_eos(tokens: list[int], eos_ids: list[int] | set[int]) -> tuple[list[int], bool]:
    """Tokens up to (not including) the first eos, and whether an eos was hit."""
    for i, t in enumerate(tokens):
        if t in eos_ids:
            return tokens[:i], True
    return tokens, False
