"""Log-probabilities of the tokens a generation emits, and of the target's most likely alternatives there.

They are the target's own: log-softmax of its raw logits at the position that decided the token (temperature,
top-k/p and min-p do not change them; mlx-lm and vLLM report the same by default), whatever proposed the token.
A speculative step reads them from the verify call's logits along the accepted path, so they cost no extra
target call; they are computed only when asked for (`DecodeOptions.logprobs`: None = off, k = the chosen token's
and the k most likely tokens'), lazily, and evaluated with the step's own sync. A prompt's own tokens can be
scored too (`of_prompt`, from the prefill's hidden states: what an evaluation harness asks a server with `echo`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

MAX_TOP_LOGPROBS = 20  # alternatives per token at most (OpenAI's and vLLM's default limit)
PROMPT_CHUNK = 512  # prompt positions whose logits `of_prompt` holds at once (~100 MB with 49,152 tokens)


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log-probability and the `top` most likely tokens there as (id, log-probability),
    best first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class Pending:
    """Log-probabilities of a run of decided tokens, not yet evaluated: (n,) chosen, (n, k) top ids and values."""

    chosen: mx.array
    logprob: mx.array
    top_ids: mx.array
    top_logprob: mx.array

    def arrays(self) -> list[mx.array]:
        """What to evaluate (with the step's own sync)."""
        return [self.chosen, self.logprob, self.top_ids, self.top_logprob]

    def host(self, count: int | None = None) -> list[TokenLogprob]:
        """The first `count` tokens' values (all by default), read from the evaluated arrays."""
        n = self.chosen.shape[0] if count is None else count
        chosen, lp = self.chosen[:n].tolist(), self.logprob[:n].tolist()
        ids, vals = self.top_ids[:n].tolist(), self.top_logprob[:n].tolist()
        return [TokenLogprob(c, v, tuple(zip(i, t))) for c, v, i, t in zip(chosen, lp, ids, vals)]


def pending(logits: mx.array, chosen: mx.array, top: int) -> Pending:
    """Log-probabilities under logits (n, V) of the tokens chosen after each row (n,), and each row's `top` most
    likely tokens (lazy)."""
    logits = logits.astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    chosen = chosen.astype(mx.int32)
    picked = mx.take_along_axis(logp, chosen[:, None], axis=-1)[:, 0]
    if top:
        ids = mx.argpartition(-logp, kth=top - 1, axis=-1)[:, :top]
        vals = mx.take_along_axis(logp, ids, axis=-1)
        order = mx.argsort(-vals, axis=-1)  # best first (ties: lowest position in the partition)
        ids, vals = mx.take_along_axis(ids, order, axis=-1), mx.take_along_axis(vals, order, axis=-1)
    else:
        ids, vals = mx.zeros((chosen.shape[0], 0), dtype=mx.int32), mx.zeros((chosen.shape[0], 0))
    return Pending(chosen, picked, ids.astype(mx.int32), vals)


def along_path(logits: mx.array, path: mx.array, drafted: mx.array, n: mx.array, next_token: mx.array,
               top: int) -> Pending:
    """A verify call's log-probabilities of what it decided: at the packed positions `path` (the root and the
    accepted drafts; logits (P, V)), the token after each is the next draft on the path (`drafted` = the path's
    tokens), and after the `n`-th (the last accepted one) the target's `next_token` (1,). `host(n + 1)` reads the
    decided ones."""
    L = path.shape[0]
    after = mx.concatenate([drafted[1:], next_token.astype(drafted.dtype)])
    after = mx.where(mx.arange(L) == n, next_token.astype(drafted.dtype), after)
    return pending(logits[path], after, top)


def of_prompt(model: Any, hidden: mx.array, prompt: list[int], top: int,
              chunk: int = PROMPT_CHUNK) -> list[TokenLogprob]:
    """Log-probabilities of each prompt token after the ones before it (the first has none, so the list is one
    shorter than the prompt), from the prefill's hidden states at every position (1, N, F); evaluated `chunk`
    positions at a time, so a long prompt never holds all its logits at once."""
    post = model.last_state(hidden)
    after = mx.array(prompt[1:], dtype=mx.int32)
    out: list[TokenLogprob] = []
    for a in range(0, len(prompt) - 1, chunk):
        b = min(a + chunk, len(prompt) - 1)
        part = pending(model.logits(post[:, a:b])[0], after[a:b], top)
        mx.eval(*part.arrays())
        out += part.host()
    return out
