"""Token-id range checks where ids enter from outside: prompts given as ids, tokenizer outputs, drafter draft
vocabularies, converted checkpoints. MLX gathers (the embedding, a draft vocabulary lookup) do not check bounds,
so an id outside [0, vocab) would read or write out of bounds instead of failing."""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Integral
from typing import Any

import mlx.core as mx

from mlx_redrafter.errors import UserError
from mlx_redrafter.schema import shown


def check_token_ids(ids: Sequence[Any], vocab_size: int, what: str) -> list[int]:
    """`ids` as a list of ints, or a one-line UserError naming `what` unless every one is an integer in
    [0, vocab_size)."""
    if not isinstance(ids, Sequence) or isinstance(ids, (str, bytes)):
        raise UserError(f"{what} must be a list of token ids (got a {type(ids).__name__})")
    bad = next((i for i in ids if not isinstance(i, Integral) or isinstance(i, bool)), None)
    if bad is not None:
        raise UserError(f"{what}: {shown(bad)} is not a token id (an integer)")
    out = [int(i) for i in ids]
    if out and (min(out) < 0 or max(out) >= vocab_size):
        first = next(i for i in out if not 0 <= i < vocab_size)
        raise UserError(f"{what}: token id {first} is outside the model's vocabulary [0, {vocab_size})")
    return out


def check_id_array(ids: mx.array, vocab_size: int, what: str) -> None:
    """One-line UserError naming `what` unless `ids` is a 1-D integer array of ids in [0, vocab_size) (one host
    sync: for load time, not decoding loops)."""
    if ids.ndim != 1 or not mx.issubdtype(ids.dtype, mx.integer):
        raise UserError(f"{what} must be a 1-D integer array of token ids (got {ids.dtype} of shape {ids.shape})")
    if ids.size:
        lo, hi = mx.min(ids).item(), mx.max(ids).item()
        if lo < 0 or hi >= vocab_size:
            raise UserError(f"{what} holds token id {lo if lo < 0 else hi}, outside the vocabulary [0, {vocab_size})")
