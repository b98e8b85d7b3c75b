"""One target call for a batch of sequences, by phase, for rows of a `RowsCache`.

    ar_step:           every row feeds its last token; every row decides one token.
    speculative_step:  draft (each row's own plan; a drafter the rows share drafts for all of them in one call)
                       -> pack (a tree per row) -> verify (one forward: per-row positions and masks; trees of
                       different sizes run ragged, without padding in the products) -> accept (per row)
                       -> commit (per row; holes)

Rows never see each other: a row's queries attend to its own committed slots and its own tree; the padding of a
narrower tree attends to the row's context and itself and is never read back. Each row's result is what the
single-sequence step (step.py) would have decided for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from mlx_redrafter.accept import accept
from mlx_redrafter.batch.cache import RowsCache
from mlx_redrafter.constraint import Constraint, allowed_next
from mlx_redrafter.draft.base import DecodeState, Proposal, Slot, propose_rows
from mlx_redrafter.logprobs import along_path
from mlx_redrafter.model import Model, Ragged
from mlx_redrafter.sampling import GREEDY, Rng, Sampling, adjust, next_token, recent_tokens
from mlx_redrafter.step import StepResult, decide, tree_allowed


@dataclass
class Row:
    """What a row brings to a step: its decode state, its draft plan and candidate length, its random stream and
    sampling settings. With `capped`, no candidate is longer than `length` (a context copy that keeps being
    accepted may otherwise grow past it): the verify budget priced the step at that length."""

    state: DecodeState
    plan: list[Slot]
    length: int
    rng: Rng | None = None
    sampling: Sampling = GREEDY
    capped: bool = False
    logprobs: int | None = None  # the decided tokens' log-probabilities with this many alternatives (logprobs.py)


def ar_step(model: Model, cache: RowsCache, tokens: mx.array, samplings: list[Sampling],
            rngs: list[Rng | None], sequences: list[list[int]] | None = None,
            constraints: list[Constraint | None] | None = None) -> tuple[mx.array, mx.array, mx.array]:
    """Feed one token per row (B,); return each row's next token (B,) under its own sampling settings, its
    hidden state there (B, H) (what a drafter conditions on) and the target's logits (B, V) (lazy). `sequences`:
    each row's tokens so far, ending with the token fed (needed only by a row with penalties); `constraints`:
    each row's grammar, advanced over that token (or None)."""
    constraints = constraints or [None] * len(samplings)
    B = cache.rows
    positions = mx.array(cache.lengths, dtype=mx.int32)[:, None]
    mask = mx.concatenate([cache.context_mask(), mx.ones((B, 1), dtype=mx.bool_)], axis=1)[:, None, None]
    logits, hidden = model(tokens[:, None], cache, positions, mask)
    cache.commit_rows(None, [1] * B)
    if all(s.greedy and not s.logit_bias and not s.penalties for s in samplings) and not any(constraints):
        return next_token(logits[:, -1], GREEDY, None), hidden[:, -1], logits[:, -1]  # one argmax for every row
    return mx.concatenate([decide(logits[r : r + 1, -1], s, rng, recent=recent_tokens(sequences[r], s),
                                  allowed=allowed_next(c))[0]
                           for r, (s, rng, c) in enumerate(zip(samplings, rngs, constraints))]), hidden[:, -1], \
        logits[:, -1]


def speculative_step(model: Model, cache: RowsCache, rows: list[Row],
                     host: list[dict[int, mx.array]] | None = None) -> list[StepResult]:
    """Every row drafts by its own plan (`host`: what its host sources already proposed, `host_proposals`); one
    target call verifies every row's tree; each row keeps its longest accepted run. Syncs once at the end (the
    accepted tokens), and after drafting unless every row has one candidate (tree sizes)."""
    proposals = propose_rows([r.plan for r in rows], [r.state for r in rows], [r.length for r in rows], host)  # draft
    proposals = [Proposal(p.candidates[:, : r.length], p.rows, min(p.chain, r.length)) if r.capped else p
                 for r, p in zip(rows, proposals)]
    if not all(p.chain for p in proposals):
        mx.eval([p.candidates for p in proposals])  # one sync for every row's tree size
    trees = [p.pack() for p in proposals]  # pack
    allowed = [None if r.state.constraint is None else tree_allowed(r.state.constraint, t)
               for r, t in zip(rows, trees)]
    P = max(t.size for t in trees)
    B, ctx = len(rows), cache.offset
    pad = [P - t.size for t in trees]
    tokens = mx.stack([mx.pad(t.tokens, [(0, n)]) for t, n in zip(trees, pad)])
    depth = mx.stack([mx.pad(t.depth, [(0, n)]) for t, n in zip(trees, pad)])
    own = mx.eye(P, dtype=mx.bool_)
    tree_mask = mx.stack([mx.pad(t.mask, [(0, n), (0, n)]) | (own & (mx.arange(P) >= t.size)[:, None])
                          for t, n in zip(trees, pad)])  # padding sees itself (and the row's context)
    context = mx.broadcast_to(cache.context_mask()[:, None, :], (B, P, ctx))
    mask = mx.concatenate([context, tree_mask], axis=2)[:, None]
    positions = mx.array(cache.lengths, dtype=mx.int32)[:, None] + depth
    sizes = [t.size for t in trees]
    ragged = Ragged(sizes) if len(set(sizes)) > 1 else None  # per-token work only on the real tokens
    logits, hidden = model(tokens, cache, positions, mask, ragged=ragged)  # verify
    if ragged is None:
        logits, hidden = logits.reshape(B * P, -1), hidden.reshape(B * P, -1)
    starts = ragged.starts if ragged is not None else [b * P for b in range(B)]
    outs = []
    for row, p, t, s, a in zip(rows, proposals, trees, starts, allowed):  # accept
        key = None if row.sampling.greedy else row.rng.next()
        recent = recent_tokens(row.state.tokens, row.sampling)
        acc = accept(p.candidates, t, adjust(logits[s : s + t.size], row.sampling, recent, t, a), row.sampling, key)
        lens = mx.cumprod(p.candidates >= 0, axis=1).sum(axis=1)  # slots before each candidate's first PAD
        drafted = t.tokens[acc.path]
        lp = None if row.logprobs is None else along_path(logits[s : s + t.size], acc.path, drafted, acc.n,
                                                          acc.next_token, row.logprobs)
        outs.append((acc, hidden[s + acc.stop][None], drafted, lens, lp))
    mx.eval([[a.n, a.path, a.next_token, h, d, a.matched, n, *(lp.arrays() if lp else ())]
             for a, h, d, n, lp in outs])
    width = max(a.path.shape[0] for a, *_ in outs)
    paths = mx.stack([mx.pad(a.path, [(0, width - a.path.shape[0])]) for a, *_ in outs])
    counts = [a.n.item() + 1 for a, *_ in outs]
    cache.commit_rows(paths, counts)  # commit
    results = []
    for (acc, h, drafted, lens, lp), p, t, c in zip(outs, proposals, trees, counts):
        n = c - 1
        matched, sizes = acc.matched.tolist(), lens.tolist()
        results.append(StepResult(
            tokens=drafted[1 : n + 1].tolist() + acc.next_token.tolist(), g0=acc.next_token.astype(mx.int32), h=h,
            accepted=n, verified=t.size, candidates=sum(sizes), longest=max(sizes),
            runs=p.by_source(matched),
            source=p.owner(matched.index(n)) if n > 0 else "", proposed=p.proposed(), logprobs=lp))
    return results
