"""The generation loops, autoregressive and speculative: they yield one record per target call (the steps are in
step.py); callers fold the records into `Stats` (or collect the tokens with `collect`).

The first record is the prefill's (its one token decided by the prompt); eos ends the generation and is not
emitted. Both loops can continue a conversation: pass the `cache` that holds the `history` tokens and only the
new `prompt` tokens.

The cache after a generation, however it ended (eos, max tokens, the caller closing the generator, an
exception): a cache the caller passed holds exactly history + prompt + every emitted token, and its offset says
so (`_Run.settle`, which raises RuntimeError if it cannot); a generation interrupted during the prefill
leaves it at the history.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import mlx.core as mx

from mlx_redrafter.accept import truncate_at_eos
from mlx_redrafter.cache import KVCache
from mlx_redrafter.constraint import Constraint, advance, allowed_next
from mlx_redrafter.draft.base import Allocator, DecodeState
from mlx_redrafter.errors import UserError
from mlx_redrafter.logprobs import Pending, TokenLogprob
from mlx_redrafter.model import Model
from mlx_redrafter.penalties import slide
from mlx_redrafter.sampling import GREEDY, Rng, Sampling, recent_tokens
from mlx_redrafter.step import ar_logits, decide, prefill_logits, speculative_step


@dataclass
class Record:
    """What one target call decided and what it cost."""

    tokens: list[int]  # the tokens emitted: those decided, cut at eos and at the token limit
    decided: int  # tokens the call decided (eos and anything past the limit included)
    seconds: float  # wall time of the call and its bookkeeping (not the caller's time between records)
    prefill: int = 0  # prompt tokens fed: the first record's; 0 for decode steps
    accepted: int = 0  # drafts accepted (speculative)
    verified: int = 0  # packed tokens the target verified
    candidates: int = 0  # candidate slots proposed, before prefix sharing
    runs: dict[str, int] = field(default_factory=dict)  # per source: the drafts its best candidate had accepted
    source: str = ""  # the source whose drafts were accepted (the first `accepted` tokens); "" when none was
    proposed: dict[str, int] = field(default_factory=dict)  # per source: candidates proposed
    phase_s: dict[str, float] = field(default_factory=dict)  # seconds per step phase (step.PHASES)
    stop: str = ""  # eos | max_tokens on the record that ended the generation
    peak_memory_gb: float = 0.0  # peak MLX memory since the generation began
    logprobs: list[TokenLogprob] | None = None  # of `tokens`, one each, when asked for (logprobs.py)
    prompt_logprobs: list[TokenLogprob] | None = None  # the prefill's: of its prompt's tokens after the first


@dataclass
class Stats:
    """Counters over a generation's records (`add`); `steps` are target calls after the prefill."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    verified_tokens: int = 0  # packed tokens the target verified
    candidate_tokens: int = 0  # candidate slots proposed, before prefix sharing
    accepted_hist: Counter = field(default_factory=Counter)  # accepted drafts per step -> count
    source_runs: Counter = field(default_factory=Counter)  # per source: sum over steps of its best run
    source_wins: Counter = field(default_factory=Counter)  # per source: steps where it had the longest run (>0)
    source_proposed: Counter = field(default_factory=Counter)  # per source: candidates proposed
    phase_s: Counter = field(default_factory=Counter)  # seconds per step phase (step.PHASES)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    peak_memory_gb: float = 0.0
    stop_reason: str = ""
    discarded_tokens: int = 0  # decided tokens dropped because they came after eos / max_tokens

    def add(self, r: Record) -> None:
        """Fold one record in."""
        self.generated_tokens += len(r.tokens)
        self.discarded_tokens += r.decided - len(r.tokens) - (r.stop == "eos")
        self.stop_reason = r.stop or self.stop_reason
        self.peak_memory_gb = max(self.peak_memory_gb, r.peak_memory_gb)
        if r.prefill:
            self.prompt_tokens += r.prefill
            self.prefill_s += r.seconds
            return
        self.steps += 1
        self.decode_s += r.seconds
        self.verified_tokens += r.verified
        self.candidate_tokens += r.candidates
        if r.runs or r.verified:  # a speculative step
            self.accepted_hist[r.accepted] += 1
        self.source_runs.update(r.runs)
        self.source_proposed.update(r.proposed)
        best = max(r.runs.values(), default=0)
        if best > 0:
            self.source_wins[next(k for k, v in r.runs.items() if v == best)] += 1
        self.phase_s.update(r.phase_s)

    @property
    def decided_tokens(self) -> int:
        """Tokens the target calls after prefill decided, a final eos included."""
        return self.generated_tokens - 1 + (self.stop_reason == "eos")

    @property
    def tokens_per_step(self) -> float:
        """Tokens decided per target call after prefill, a final eos included (1.0 for AR)."""
        return self.decided_tokens / self.steps if self.steps else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return (self.generated_tokens - 1) / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    def source_tokens_per_step(self) -> dict[str, float]:
        """Per source: tokens per target call it would have decided alone (its best run + 1, averaged)."""
        return {k: round(1 + v / self.steps, 4) for k, v in self.source_runs.items()} if self.steps else {}

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens, "generated_tokens": self.generated_tokens,
            "steps": self.steps, "tokens_per_step": round(self.tokens_per_step, 4),
            "verified_tokens": self.verified_tokens, "candidate_tokens": self.candidate_tokens,
            "accepted_histogram": {str(k): v for k, v in sorted(self.accepted_hist.items())},
            "source_tokens_per_step": self.source_tokens_per_step(),
            "source_wins": dict(self.source_wins), "source_proposed": dict(self.source_proposed),
            "prefill_s": round(self.prefill_s, 4), "decode_s": round(self.decode_s, 4),
            "prefill_tokens_per_s": round(self.prefill_tokens_per_s, 2),
            "decode_tokens_per_s": round(self.decode_tokens_per_s, 2),
            "phase_s": {k: round(v, 4) for k, v in self.phase_s.items()},
            "peak_memory_gb": round(self.peak_memory_gb, 3),
            "stop_reason": self.stop_reason, "discarded_tokens": self.discarded_tokens,
        }


def collect(records: Iterable[Record]) -> tuple[list[int], Stats]:
    """Every emitted token of a generation and its statistics."""
    tokens, stats = [], Stats()
    for r in records:
        tokens.extend(r.tokens)
        stats.add(r)
    return tokens, stats


class Emitter:
    """Applies eos and the token limit to the tokens a call decides; counts what was emitted."""

    def __init__(self, max_tokens: int, eos_ids: list[int]):
        self.max_tokens, self.eos_ids = max_tokens, set(eos_ids)
        self.emitted: list[int] = []
        self.stop = "" if max_tokens > 0 else "max_tokens"

    @property
    def done(self) -> bool:
        return bool(self.stop)

    def __call__(self, decided: list[int]) -> list[int]:
        tokens, hit_eos = truncate_at_eos(decided[: self.max_tokens - len(self.emitted)], self.eos_ids)
        self.emitted.extend(tokens)
        if hit_eos:
            self.stop = "eos"
        elif len(self.emitted) >= self.max_tokens:
            self.stop = "max_tokens"
        return tokens


class _Run:
    """One generation's cache, sampler and emitter, and the records' clock."""

    def __init__(self, model: Model, prompt: list[int], cache: KVCache | None, history: list[int], extra: int,
                 max_tokens: int, sampling: Sampling, eos_ids: list[int]):
        if not prompt:
            raise UserError("the prompt is empty: give at least one token")
        self.model, self.prompt, self.own_cache = model, prompt, cache is None
        self.cache = cache if cache is not None else model.make_cache(len(prompt) + max_tokens + extra)
        if self.cache.offset != len(history):
            raise ValueError(f"the cache holds {self.cache.offset} tokens but the history has {len(history)}")
        self.base = self.cache.offset
        self.rng = None if sampling.greedy else Rng(sampling.seed)
        self.emit = Emitter(max_tokens, list(eos_ids))
        self.prefilled = False
        mx.reset_peak_memory()
        self.t = time.perf_counter()

    def record(self, decided: list[int], logprobs: Pending | None = None, **costs) -> Record:
        """The record of a call that decided `decided` (timed since the previous record or `resume`), with the
        emitted tokens' log-probabilities read from the evaluated `logprobs` of `decided`."""
        now = time.perf_counter()
        tokens = self.emit(decided)
        return Record(tokens=tokens, decided=len(decided), seconds=now - self.t, stop=self.emit.stop,
                      peak_memory_gb=mx.get_peak_memory() / 1e9,
                      logprobs=None if logprobs is None else logprobs.host(len(tokens)), **costs)

    def resume(self) -> None:
        """The caller handed control back: the next record's clock starts now."""
        self.t = time.perf_counter()

    def settle(self) -> None:
        """Make the cache hold exactly history + prompt + emitted tokens (see the module docstring); raises
        RuntimeError (a bug, not bad input) when it cannot."""
        want = self.base + len(self.prompt) + len(self.emit.emitted)
        if not self.prefilled:
            self.cache.truncate(self.base)
            return
        if self.cache.offset > want:
            self.cache.truncate(want)
        elif self.cache.offset == want - 1 and not self.own_cache:  # the last emitted token is not fed yet
            self.model(mx.array([self.emit.emitted[-1:]]), self.cache)
            self.cache.advance(1)
            mx.eval(*self.cache.state())
        # A cache of our own is dropped, so its last token need not be fed.
        allowed = (want - 1, want) if self.own_cache else (want,)
        if self.cache.offset not in allowed:
            raise RuntimeError(f"internal error: after the generation the cache holds {self.cache.offset} tokens, "
                               f"not history + prompt + emitted = {want}")


def generate_ar(model: Model, prompt: list[int], *, max_tokens: int = 256, eos_ids: list[int] = (),
                sampling: Sampling = GREEDY, cache: KVCache | None = None, history: list[int] = (),
                logprobs: int | None = None, constraint: Constraint | None = None) -> Iterator[Record]:
    """Autoregressive decoding; each step is queued before the previous token is read (as mlx-lm does; under a
    `constraint`, a grammar the answer follows, the step's forward is, and its choice waits for the grammar's mask
    after the previous token). With `logprobs` = k, each token's log-probability and k alternatives come along
    (logprobs.py)."""
    run = _Run(model, prompt, cache, list(history), 1, max_tokens, sampling, eos_ids)
    cache, rng = run.cache, run.rng
    recent = recent_tokens([*history, *prompt], sampling)

    def forward(token: mx.array) -> mx.array:
        nonlocal recent
        recent = None if recent is None else slide(recent, token)  # the sequence now ends with `token`
        return ar_logits(model, cache, token)

    def choose(logits: mx.array) -> tuple[mx.array, Pending | None]:
        return decide(logits, sampling, rng, logprobs, recent, allowed_next(constraint))

    def step(token: mx.array) -> tuple[mx.array, Pending | None] | mx.array:
        """What is queued ahead: the next choice, or under a grammar the logits it will read."""
        return forward(token) if constraint is not None else choose(forward(token))

    try:
        logits, _ = prefill_logits(model, cache, prompt)
        g0, lp = decide(logits, sampling, rng, logprobs, recent, allowed_next(constraint))
        first = g0.item()
        advance(constraint, [first])
        run.prefilled = True
        yield run.record([first], lp, prefill=len(prompt))
        run.resume()
        queued = None
        while not run.emit.done:
            ahead = queued if queued is not None else step(g0)
            g0, lp = choose(ahead) if constraint is not None else ahead
            more = len(run.emit.emitted) + 1 < max_tokens
            queued = step(g0) if more else None
            if constraint is not None:
                mx.async_eval(g0, *(lp.arrays() if lp else ()), *([] if queued is None else [queued]))
            else:
                ahead = (g0, lp) if queued is None else queued
                mx.async_eval(ahead[0], *(ahead[1].arrays() if ahead[1] else ()))
            token = g0.item()
            advance(constraint, [token])
            yield run.record([token], lp)
            run.resume()
    finally:
        run.settle()


def generate_speculative(model: Model, prompt: list[int], allocator: Allocator, *, length: int,
                         max_tokens: int = 256, eos_ids: list[int] = (), sampling: Sampling = GREEDY,
                         cache: KVCache | None = None, history: list[int] = (),
                         profile: bool = False, logprobs: int | None = None,
                         constraint: Constraint | None = None) -> Iterator[Record]:
    """Speculative decoding with the allocator's draft sources; candidates are `length` tokens (g0 included; a
    growing lookup copy may be longer). `profile=True` times every phase of a step honestly (`Record.phase_s`);
    `logprobs` and `constraint` as in `generate_ar`."""
    run = _Run(model, prompt, cache, list(history), allocator.candidate_budget(length), max_tokens, sampling,
               eos_ids)
    cache, rng = run.cache, run.rng
    try:
        logits, h = prefill_logits(model, cache, prompt)
        g0, lp = decide(logits, sampling, rng, logprobs, recent_tokens([*history, *prompt], sampling),
                        allowed_next(constraint))
        first = g0.item()
        advance(constraint, [first])
        run.prefilled = True
        state = DecodeState(tokens=[*history, *prompt, first], g0=g0.astype(mx.int32), h=h, constraint=constraint)
        for src in allocator.sources:
            src.start(state.tokens)
        yield run.record([first], lp, prefill=len(prompt))
        run.resume()
        while not run.emit.done:
            r = speculative_step(model, cache, state, allocator.plan(), length, sampling, rng, profile, logprobs)
            state.tokens.extend(r.tokens)
            advance(constraint, r.tokens)
            state.g0, state.h = r.g0, r.h
            for src in allocator.sources:
                src.extend(r.tokens)
            allocator.update(r.runs)
            yield run.record(r.tokens, r.logprobs, accepted=r.accepted, verified=r.verified, candidates=r.candidates,
                             runs=r.runs, source=r.source, proposed=r.proposed, phase_s=r.seconds)
            run.resume()
    finally:
        run.settle()
