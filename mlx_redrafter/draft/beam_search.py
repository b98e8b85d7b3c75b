"""Drafter beam search: W candidate continuations of length L, fully in MLX (no host sync inside).

Any recurrent drafter works: an object with `next_state(state, token_emb)`, `logits(context, state)` and
`token_ids(head_index)` (the ReDrafter `Drafter`, the semi-autoregressive drafter); its state starts as
`initial_state(B, W, dtype)` if it has one, else zeros of the target's hidden size (the ReDrafter's RNN state);
`context(hidden)`, where it has one, turns the target's features into the context the head conditions on.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Protocol

import mlx.core as mx

from mlx_redrafter.draft.base import DecodeState, Source


class RecurrentDrafter(Protocol):
    """What beam search needs of a drafter (`initial_state(B, W, dtype)` is optional)."""

    def next_state(self, state: mx.array, token_emb: mx.array) -> mx.array: ...

    def logits(self, context: mx.array, state: mx.array) -> mx.array: ...

    def token_ids(self, head_index: mx.array) -> mx.array: ...


LOG_0 = -50000.0  # "log(0)" of the reference implementation, kept finite so sums never give NaN


def warp_top_k(logits: mx.array, top_k: int) -> mx.array:
    """Subtract the row max and set everything below the row's top-k to LOG_0 (as the reference does)."""
    logits = logits - mx.max(logits, axis=-1, keepdims=True)
    if top_k and top_k < logits.shape[-1]:
        kth = mx.min(mx.topk(logits, top_k, axis=-1), axis=-1, keepdims=True)
        logits = mx.where(logits < kth, LOG_0, logits)
    return logits


def context_of(drafter: RecurrentDrafter, hidden: mx.array) -> mx.array:
    """The context a drafter's head conditions on, from the target's features at the last accepted position."""
    context = getattr(drafter, "context", None)
    return hidden if context is None else context(hidden)


def beam_search(
    drafter: RecurrentDrafter,
    embed: Callable[[mx.array], mx.array],
    context: mx.array,  # (B, F) the target's features at the last accepted position (`Model`'s hidden)
    first_token: mx.array,  # (B,) int: g0, the target's prediction there
    width: int,
    length: int,
    top_k: int = 50,
) -> tuple[mx.array, mx.array]:
    """Return beams (B, W, L) int32 with column 0 = first_token, and the drafter's log-probs of the
    drafted tokens (B, W, L-1)."""
    context = context_of(drafter, context)
    B, H = context.shape
    ctx = mx.broadcast_to(context[:, None, :], (B, width, H))
    beams = mx.broadcast_to(first_token.astype(mx.int32)[:, None, None], (B, width, 1))
    scores = mx.array([0.0] + [-float("inf")] * (width - 1))[None].astype(mx.float32)  # (1, W)
    init = getattr(drafter, "initial_state", None)
    state = init(B, width, context.dtype) if init is not None else mx.zeros((B, width, H), dtype=context.dtype)
    token_lp = mx.zeros((B, width, 0), dtype=mx.float32)
    for _ in range(length - 1):
        state = drafter.next_state(state, embed(beams[:, :, -1]))
        logp = warp_top_k(drafter.logits(ctx, state).astype(mx.float32), top_k)
        logp = logp - mx.logsumexp(logp, axis=-1, keepdims=True)  # (B, W, K)
        K = logp.shape[-1]
        cand = (logp + scores[:, :, None]).reshape(B, width * K)
        top = mx.argpartition(-cand, kth=width - 1, axis=-1)[:, :width]
        top_scores = mx.take_along_axis(cand, top, axis=-1)
        order = mx.argsort(-top_scores, axis=-1)  # best beam first; deterministic
        top = mx.take_along_axis(top, order, axis=-1)
        scores = mx.take_along_axis(top_scores, order, axis=-1)
        src, head_idx = top // K, top % K  # (B, W) parent beam, head index
        beams = mx.concatenate(
            [mx.take_along_axis(beams, src[:, :, None], axis=1), drafter.token_ids(head_idx)[:, :, None]], axis=-1
        )
        state = mx.take_along_axis(state, src[:, :, None], axis=1)
        chosen = mx.take_along_axis(logp.reshape(B, width * K), top, axis=-1)  # (B, W)
        token_lp = mx.concatenate([mx.take_along_axis(token_lp, src[:, :, None], axis=1), chosen[:, :, None]], -1)
    return beams, token_lp


def greedy_steps(drafter: RecurrentDrafter, embed: Callable[[mx.array], mx.array], context: mx.array,
                 first_token: mx.array, length: int) -> Iterator[tuple[mx.array, mx.array]]:
    """Greedy drafting (one beam) a token at a time: for each of the L - 1 drafts, the drafted tokens (B, 1) int32
    and the drafter's logits they are the argmax of (B, 1, K) (lazy; `top_log_probability` turns them into the
    drafter's log-probability of its token)."""
    context = context_of(drafter, context)
    B, H = context.shape
    tok = first_token.astype(mx.int32)[:, None]  # (B, 1)
    init = getattr(drafter, "initial_state", None)
    state = init(B, 1, context.dtype) if init is not None else mx.zeros((B, 1, H), dtype=context.dtype)
    ctx = context[:, None, :]
    for _ in range(length - 1):
        state = drafter.next_state(state, embed(tok))
        logits = drafter.logits(ctx, state)  # (B, 1, K)
        tok = drafter.token_ids(mx.argmax(logits, axis=-1)).astype(mx.int32)
        yield tok, logits


def top_log_probability(logits: mx.array) -> mx.array:
    """(..., K) -> (...): the log-probability of the argmax under the softmax over the last axis (float32)."""
    logits = logits.astype(mx.float32)
    return mx.max(logits, axis=-1) - mx.logsumexp(logits, axis=-1)


def greedy_draft(drafter: RecurrentDrafter, embed: Callable[[mx.array], mx.array], context: mx.array,
                 first_token: mx.array, length: int) -> mx.array:
    """Beam search with one beam, without the beam bookkeeping: (B, 1, L) int32, column 0 = first_token."""
    drafts = [tok for tok, _ in greedy_steps(drafter, embed, context, first_token, length)]
    return mx.concatenate([first_token.astype(mx.int32)[:, None], *drafts], axis=-1)[:, None, :]


def confident_draft(drafter: RecurrentDrafter, embed: Callable[[mx.array], mx.array], context: mx.array,
                    first_token: mx.array, length: int, min_confidence: float = 0.0
                    ) -> tuple[mx.array, list[int] | None]:
    """Greedy drafting (one beam) that stops where the drafter doubts: (B, 1, L') int32 drafts, column 0 =
    first_token, and each row's length (tokens with first_token, host ints; None without `min_confidence`).

    A row's draft ends before the first token at which the drafter's probability of the whole draft (the product
    of its tokens' probabilities under the drafter's softmax) falls below `min_confidence`; drafting stops when
    every row's has ended (L' <= L). That probability predicts how often the target accepts the draft (the
    drafter is calibrated: see docs/options.md, `python -m bench calibration`), so the cut keeps the tokens worth
    verifying. Each row's cut depends on its own probabilities only. It reads them on the host once per drafted
    token; without a threshold (0) nothing is read and the drafts are those of `greedy_draft` (lazy)."""
    if min_confidence <= 0:
        return greedy_draft(drafter, embed, context, first_token, length), None
    floor = math.log(min_confidence)
    out = [first_token.astype(mx.int32)[:, None]]
    logp = mx.zeros((context.shape[0], 1), dtype=mx.float32)
    lengths = [1] * context.shape[0]
    for tok, logits in greedy_steps(drafter, embed, context, first_token, length):
        logp = logp + top_log_probability(logits)  # only falls: a row above the floor has been above it all along
        sure = (logp[:, 0] >= floor).tolist()
        if not any(sure):  # every row has ended
            break
        lengths = [n + ok for n, ok in zip(lengths, sure)]
        out.append(tok)
    return mx.concatenate(out, axis=-1)[:, None, :], lengths


class BeamSource(Source):
    """Candidates of a recurrent drafter: `width` beams of `length` tokens from the target's hidden state and g0
    (width 1: greedy drafting, cut where the drafter's confidence falls below `min_confidence` if it is > 0,
    `confident_draft`). Rows of a batch that share the drafter draft together (`propose_many`)."""

    name = "beam"
    pads = False

    def __init__(self, drafter: RecurrentDrafter, embed: Callable[[mx.array], mx.array], key: tuple = (),
                 min_confidence: float = 0.0):
        """`key`: what besides the drafter, the embedding and the threshold makes two sources draft differently."""
        self.drafter, self.embed, self.min_confidence = drafter, embed, min_confidence
        owner = getattr(embed, "__self__", embed)  # a bound method is a new object at every attribute access
        self.batch_key = (type(self).__name__, id(owner), getattr(embed, "__name__", ""), min_confidence,
                          *(key or (id(drafter),)))

    def propose(self, state: DecodeState, length: int, width: int) -> mx.array | None:
        return self.propose_many([state], length, width)[0]

    def propose_many(self, states: list[DecodeState], length: int, width: int) -> list[mx.array | None]:
        h = states[0].h if len(states) == 1 else mx.concatenate([s.h for s in states])
        g0 = states[0].g0 if len(states) == 1 else mx.concatenate([s.g0 for s in states])
        if width == 1:
            beams, lengths = confident_draft(self.drafter, self.embed, h, g0, length, self.min_confidence)
            if lengths is not None:  # each row's draft up to its cut: a chain, packed without a sync
                return [beams[b, :, :n] for b, n in enumerate(lengths)]
        else:
            beams, _ = beam_search(self.drafter, self.embed, h, g0, width, length)
        return [beams[b] for b in range(len(states))]
