"""The generation loops: autoregressive and speculative. They only keep records; the steps are in step.py.

Both yield lists of new token ids as they become final; eos ends the generation and is not emitted. Both can
continue a conversation: pass the `cache` that holds the `history` tokens and only the new `prompt` tokens.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import mlx.core as mx

from mlx_redrafter.accept import truncate_at_eos
from mlx_redrafter.cache import KVCache
from mlx_redrafter.model import Model
from mlx_redrafter.sampling import GREEDY, Rng, Sampling
from mlx_redrafter.sources import Allocator, DecodeState, longest
from mlx_redrafter.step import ar_step, prefill, speculative_step


@dataclass
class Stats:
    """Per-generation counters; `steps` are target calls after prefill."""

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

    @property
    def tokens_per_step(self) -> float:
        """Tokens decided per target call after prefill, a final eos included (1.0 for AR)."""
        decided = self.generated_tokens - 1 + (self.stop_reason == "eos")
        return decided / self.steps if self.steps else 0.0

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


class Emitter:
    """Applies eos and max-token limits to the tokens a step decides."""

    def __init__(self, stats: Stats, max_tokens: int, eos_ids: list[int]):
        self.stats, self.max_tokens, self.eos_ids = stats, max_tokens, set(eos_ids)
        self.done = max_tokens <= 0

    def __call__(self, tokens: list[int]) -> list[int]:
        decided = len(tokens)
        tokens, hit_eos = truncate_at_eos(tokens[: self.max_tokens - self.stats.generated_tokens], self.eos_ids)
        self.stats.generated_tokens += len(tokens)
        self.stats.discarded_tokens += decided - len(tokens) - hit_eos
        if hit_eos:
            self.done, self.stats.stop_reason = True, "eos"
        elif self.stats.generated_tokens >= self.max_tokens:
            self.done, self.stats.stop_reason = True, "max_tokens"
        return tokens


@dataclass
class _Started:
    """What both loops hold after the prefill: the cache, records, sampler state and the first token."""

    cache: KVCache
    stats: Stats
    rng: Rng | None
    emit: Emitter
    g0: mx.array  # the first token, decided by the prefill
    h: mx.array  # the target's last hidden state
    first: int


def _start(model: Model, prompt: list[int], cache: KVCache | None, extra: int, max_tokens: int,
           stats: Stats | None, sampling: Sampling, eos_ids: list[int]) -> _Started:
    """Size the cache (prompt + answer + `extra` scratch positions) and prefill the prompt."""
    stats = stats if stats is not None else Stats()
    stats.prompt_tokens = len(prompt)
    if cache is None:
        cache = model.make_cache(len(prompt) + max_tokens + extra)
    mx.reset_peak_memory()
    rng = None if sampling.greedy else Rng(sampling.seed)
    t0 = time.perf_counter()
    g0, h = prefill(model, cache, prompt, sampling, rng)
    first = g0.item()
    stats.prefill_s = time.perf_counter() - t0
    return _Started(cache, stats, rng, Emitter(stats, max_tokens, list(eos_ids)), g0, h, first)


def generate_ar(model: Model, prompt: list[int], *, max_tokens: int = 256, eos_ids: list[int] = (),
                sampling: Sampling = GREEDY, stats: Stats | None = None, cache: KVCache | None = None,
                ) -> Iterator[list[int]]:
    """Autoregressive decoding; each step is queued before the previous token is read (as mlx-lm does)."""
    s = _start(model, prompt, cache, 1, max_tokens, stats, sampling, eos_ids)
    cache, stats, rng, emit, g0 = s.cache, s.stats, s.rng, s.emit, s.g0
    t_start = time.perf_counter()
    out = emit([s.first])
    if out:
        yield out
    queued = None
    while not emit.done:
        g0 = queued if queued is not None else ar_step(model, cache, g0, sampling, rng)
        queued = ar_step(model, cache, g0, sampling, rng) if stats.generated_tokens + 1 < max_tokens else None
        mx.async_eval(g0 if queued is None else queued)
        stats.steps += 1
        out = emit([g0.item()])
        if out:
            yield out
    stats.decode_s = time.perf_counter() - t_start
    stats.peak_memory_gb = mx.get_peak_memory() / 1e9


def generate_speculative(model: Model, prompt: list[int], allocator: Allocator, *, length: int,
                         max_tokens: int = 256, eos_ids: list[int] = (), sampling: Sampling = GREEDY,
                         stats: Stats | None = None, cache: KVCache | None = None, history: list[int] = (),
                         profile: bool = False) -> Iterator[list[int]]:
    """Speculative decoding with the allocator's draft sources; candidates are `length` tokens (g0 included; a
    growing lookup copy may be longer)."""
    budget = sum(s.width * longest(s, length) for s in allocator.slots)
    s = _start(model, prompt, cache, budget, max_tokens, stats, sampling, eos_ids)
    cache, stats, rng, emit, first = s.cache, s.stats, s.rng, s.emit, s.first
    t_start = time.perf_counter()
    state = DecodeState(tokens=[*history, *prompt, first], g0=s.g0.astype(mx.int32), h=s.h)
    for src in allocator.sources:
        src.start(state.tokens)
    out = emit([first])
    if out:
        yield out
    while not emit.done:
        r = speculative_step(model, cache, state, allocator.plan(), length, sampling, rng, profile)
        state.tokens.extend(r.tokens)
        state.g0, state.h = r.g0, r.h
        for src in allocator.sources:
            src.extend(r.tokens)
        allocator.update(r.runs)
        stats.steps += 1
        stats.verified_tokens += r.verified
        stats.candidate_tokens += r.candidates
        stats.accepted_hist[r.accepted] += 1
        stats.source_runs.update(r.runs)
        stats.source_proposed.update(r.proposed)
        best = max(r.runs.values(), default=0)
        if best > 0:
            stats.source_wins[next(k for k, v in r.runs.items() if v == best)] += 1
        stats.phase_s.update(r.seconds)
        out = emit(r.tokens)
        if out:
            yield out
    stats.decode_s = time.perf_counter() - t_start
    stats.peak_memory_gb = mx.get_peak_memory() / 1e9
