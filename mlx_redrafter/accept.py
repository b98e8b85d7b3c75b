"""Greedy acceptance: the longest prefix of any beam that the target itself would have produced."""

from __future__ import annotations

import mlx.core as mx


def accept_greedy(beams: mx.array, target_next: mx.array) -> tuple[mx.array, mx.array]:
    """beams (W, L) and the target's argmax after each beam slot (W, L) -> (best beam, accepted drafts n).

    Draft token k of a beam is accepted iff every draft before it was and it equals the target's
    prediction at slot k-1. Ties go to the lowest beam index.
    """
    ok = (beams[:, 1:] == target_next[:, :-1]).astype(mx.int32)  # (W, L-1)
    run = mx.cumprod(ok, axis=1).sum(axis=1)  # (W,) accepted drafts per beam
    best = mx.argmax(run)  # first maximum
    return best, run[best]


def truncate_at_eos(tokens: list[int], eos_ids: list[int] | set[int]) -> tuple[list[int], bool]:
    """Tokens up to (not including) the first eos, and whether an eos was hit."""
    for i, t in enumerate(tokens):
        if t in eos_ids:
            return tokens[:i], True
    return tokens, False
