"""Training losses of a drafter: teacher-forced logits for T draft steps, hard or soft (distilled) labels."""

from __future__ import annotations

import mlx.core as mx

from mlx_redrafter.draft.beam_search import context_of
from mlx_redrafter.system.vector_math import log_probs_at
from mlx_redrafter.train.data import Batch


def teacher_forced_logits(drafter, h: mx.array, emb_in: mx.array) -> mx.array:
    """Head logits (B, T, K) for the target's states h (B, H; with the tapped layers' for a drafter that fuses
    some, B, H (1 + n)) and input embeddings (B, T, H).

    The recurrent drafter unrolls its RNN exactly as beam search does at inference (its context from h, state 0,
    then one update per consumed token); drafters with their own `teacher_forced_logits` method (e.g. Medusa,
    semi-AR) use it.
    """
    own = getattr(drafter, "teacher_forced_logits", None)
    if own is not None:
        return own(h, emb_in)
    S = recurrent_states(drafter, emb_in, h.dtype)
    return drafter.logits(mx.broadcast_to(context_of(drafter, h)[:, None, :], S.shape), S)


def recurrent_states(drafter, emb_in: mx.array, dtype: mx.Dtype = mx.float32) -> mx.array:
    """The recurrent drafter's states (B, T, H) after consuming each of the input embeddings (B, T, H), from state
    0, as beam search updates them at inference."""
    B, T, H = emb_in.shape
    s = mx.zeros((B, H), dtype=dtype)
    states = []
    for j in range(T):
        s = drafter.next_state(s, emb_in[:, j])
        states.append(s)
    return mx.stack(states, axis=1)


def cross_entropy(logits: mx.array, target: mx.array) -> mx.array:
    """-log softmax(logits)[target] per position (logits (..., K), target (...) indices)."""
    return -log_probs_at(logits, target[..., None])[..., 0]


def hard_loss(logits: mx.array, b: Batch) -> mx.array:
    """Mean cross-entropy against the target's top-1 token at each step, over steps whose label is in the head."""
    ce = cross_entropy(logits, b.target)
    return (ce * b.weight).sum() / mx.maximum(b.weight.sum(), 1.0)


def soft_loss(logits: mx.array, b: Batch) -> mx.array:
    """Cross-entropy against the target's top-k distribution at each step (renormalized within the head)."""
    logq = log_probs_at(logits, b.soft_index)  # (B, T, k)
    ce = -(b.soft_prob * logq).sum(axis=-1)
    has = (b.soft_prob.sum(axis=-1) > 0).astype(ce.dtype)
    return ce.sum() / mx.maximum(has.sum(), 1.0)
