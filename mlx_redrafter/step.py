"""One decoding step, by phase: prefill, an autoregressive step, and the speculative step.

    speculative_step:  draft (draft/base.py) -> pack (tree.py) -> verify (model.py) -> accept (accept.py)
                       -> commit (cache.py)

Every function works on one sequence and keeps MLX lazy: the speculative step syncs at its end, to read the
accepted tokens, after drafting where it has several candidates (to learn the packed tree's size), and under a grammar
(constraint.py) to read the tree's tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import mlx.core as mx

from mlx_redrafter.accept import accept
from mlx_redrafter.cache import KVCache
from mlx_redrafter.constraint import Constraint
from mlx_redrafter.draft.base import DecodeState, Slot, propose
from mlx_redrafter.logprobs import Pending, along_path, pending
from mlx_redrafter.model import Model, forward_chunked
from mlx_redrafter.sampling import GREEDY, Rng, Sampling, adjust, next_token, recent_tokens
from mlx_redrafter.tree import PackedTree, verify_mask

PHASES = ("draft", "pack", "verify", "accept", "commit")


def decide(logits: mx.array, sampling: Sampling = GREEDY, rng: Rng | None = None,
           logprobs: int | None = None, recent: mx.array | None = None,
           allowed: mx.array | None = None) -> tuple[mx.array, Pending | None]:
    """The target's next token from its logits (1, V) (`sampling.adjust`ed; `recent`: the latest tokens of the
    sequence, for penalties; `allowed`: what a grammar allows), and with `logprobs` = k that token's
    log-probability and k alternatives, the target's own (logprobs.py) (lazy)."""
    token = next_token(adjust(logits, sampling, recent, allowed=allowed), sampling, rng)
    return token, None if logprobs is None else pending(logits, token, logprobs)


def prefill_logits(model: Model, cache: KVCache, prompt: list[int]) -> tuple[mx.array, mx.array]:
    """Feed the prompt at positions offset..offset+n-1; return the target's logits (1, V) and hidden state (1, H)
    at its last position (lazy)."""
    logits, hidden = forward_chunked(model, cache, mx.array([prompt]))
    return logits[:, -1], hidden[:, -1]


def prefill(model: Model, cache: KVCache, prompt: list[int], sampling: Sampling = GREEDY,
            rng: Rng | None = None, recent: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """Feed the prompt (`prefill_logits`); return (g0 (1,), h (1, H)): the target's next token (`decide`) and its
    hidden state at the prompt's last position (lazy)."""
    logits, hidden = prefill_logits(model, cache, prompt)
    return decide(logits, sampling, rng, recent=recent)[0], hidden


def ar_logits(model: Model, cache: KVCache, token: mx.array) -> mx.array:
    """Feed one token (1,); return the target's logits after it (1, V) (lazy)."""
    logits, _ = model(token[:, None], cache)
    cache.advance(1)
    return logits[:, -1]


def ar_step(model: Model, cache: KVCache, token: mx.array, sampling: Sampling = GREEDY,
            rng: Rng | None = None, recent: mx.array | None = None) -> mx.array:
    """Feed one token (1,); return the target's next token (1,) (`decide`) (lazy)."""
    return decide(ar_logits(model, cache, token), sampling, rng, recent=recent)[0]


@dataclass
class StepResult:
    """What one speculative step decided and what it cost."""

    tokens: list[int]  # accepted drafts followed by the target's next token (the next g0)
    g0: mx.array  # (1,) that next token
    h: mx.array  # (1, H) hidden state at the last accepted position
    accepted: int  # drafts accepted
    verified: int  # packed tokens the target verified
    candidates: int  # candidate slots proposed (before prefix sharing, PAD excluded)
    longest: int  # tokens of the longest candidate (g0 included)
    runs: dict[str, int]  # per source: the drafts its best candidate would have had accepted
    source: str  # the source whose drafts were accepted ("" when none was)
    proposed: dict[str, int]  # per source: candidates proposed
    seconds: dict[str, float] = field(default_factory=dict)  # per phase (see `profile`)
    logprobs: Pending | None = None  # of the decided tokens (evaluated), when asked for


def speculative_step(model: Model, cache: KVCache, state: DecodeState, plan: list[Slot], length: int,
                     sampling: Sampling = GREEDY, rng: Rng | None = None, profile: bool = False,
                     logprobs: int | None = None) -> StepResult:
    """Draft candidates of `length` tokens from every source in `plan`, verify them in one target call, keep
    the longest accepted run and commit its KV entries. With `logprobs` = k, the decided tokens' log-probabilities
    and k alternatives each come along (logprobs.py).

    Without `profile` the phases are timed at the step's two syncs ("draft" includes packing; "verify"
    includes acceptance and the commit's graph). With `profile=True` every phase is evaluated before its clock
    stops: an honest split, at the price of a slower step.
    """
    clock = _Clock(profile)
    proposal = propose(plan, state, length)  # draft
    cands = proposal.candidates
    clock.lap("draft", cands)
    if proposal.chain:  # one candidate: drafting starts now (on a GPU it runs while the verify graph is built;
        # MLX's CPU backend keeps ~10 operations in flight, so there only its last few do)
        mx.async_eval(cands)
    tree = proposal.pack()  # pack (syncs once to learn the packed size, unless one candidate: a chain)
    allowed = None if state.constraint is None else tree_allowed(state.constraint, tree)
    clock.lap("pack", tree.mask, tree.parent, unprofiled="draft")
    positions = (cache.offset + tree.depth)[None]  # verify
    logits, hidden = model(tree.tokens[None], cache, positions, verify_mask(tree.mask, cache.offset))
    clock.lap("verify", logits, hidden)
    recent = recent_tokens(state.tokens, sampling)  # accept
    acc = accept(cands, tree, adjust(logits[0], sampling, recent, tree, allowed), sampling,
                 None if sampling.greedy else rng.next())
    h = hidden[0, acc.stop][None]
    drafted = tree.tokens[acc.path]
    lens = mx.cumprod(cands >= 0, axis=1).sum(axis=1)  # slots before each candidate's first PAD
    lp = None if logprobs is None else along_path(logits[0], acc.path, drafted, acc.n, acc.next_token, logprobs)
    mx.eval(acc.n, acc.path, acc.next_token, h, drafted, acc.matched, lens, *(lp.arrays() if lp else ()))
    clock.lap("accept", unprofiled="verify")
    n = acc.n.item()
    cache.commit(acc.path, n + 1)  # commit (a copy only if the path is not in place; lazy)
    clock.lap("commit", *cache.state())
    tokens = drafted[1 : n + 1].tolist() + acc.next_token.tolist()
    sizes = lens.tolist()
    matched = acc.matched.tolist()
    runs = proposal.by_source(matched)
    source = proposal.owner(matched.index(n)) if n > 0 else ""
    return StepResult(tokens=tokens, g0=acc.next_token.astype(mx.int32), h=h, accepted=n, verified=tree.size,
                      candidates=sum(sizes), longest=max(sizes), runs=runs, source=source,
                      proposed=proposal.proposed(), seconds=clock.seconds, logprobs=lp)


def tree_allowed(constraint: Constraint, tree: PackedTree) -> mx.array:
    """(P, V) bool: what the grammar allows after each node of the tree (`Constraint.allowed_tree`; syncs to read
    the tree's tokens)."""
    mx.eval(tree.tokens, tree.parent)
    return constraint.allowed_tree(tree.tokens.tolist(), tree.parent.tolist())


class _Clock:
    """Phase timer: laps at the step's syncs, or (profiling) after evaluating each phase's outputs."""

    def __init__(self, profile: bool):
        self.profile = profile
        self.seconds: dict[str, float] = {}
        self.t = time.perf_counter()

    def lap(self, phase: str, *outputs: mx.array, unprofiled: str | None = None) -> None:
        """Profiling: evaluate `outputs`, then book the time since the last lap to `phase`. Otherwise book it
        to `unprofiled` (a lap at a sync the step does anyway), or do nothing."""
        if self.profile:
            mx.eval(*outputs)
        elif unprofiled is None:
            return
        else:
            phase = unprofiled
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self.t
        self.t = now
