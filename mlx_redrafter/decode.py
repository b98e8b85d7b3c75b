"""The decode loops: autoregressive baseline and ReDrafter (draft -> pack -> verify -> accept -> commit).

Both yield lists of new token ids as they become final; eos ends the generation and is not emitted.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import mlx.core as mx

from .accept import accept_greedy, truncate_at_eos
from .beam_search import beam_search
from .cache import KVCache
from .drafter import Drafter
from .model import Model
from .tree import pack, verify_mask


@dataclass
class Stats:
    """Per-generation counters; `steps` are target calls after prefill."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    verified_tokens: int = 0  # packed tokens the target verified
    candidate_tokens: int = 0  # W x L per step, before dedup
    accepted_hist: Counter = field(default_factory=Counter)  # accepted drafts per step -> count
    prefill_s: float = 0.0
    decode_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    accept_s: float = 0.0
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

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens, "generated_tokens": self.generated_tokens,
            "steps": self.steps, "tokens_per_step": round(self.tokens_per_step, 4),
            "verified_tokens": self.verified_tokens, "candidate_tokens": self.candidate_tokens,
            "accepted_histogram": {str(k): v for k, v in sorted(self.accepted_hist.items())},
            "prefill_s": round(self.prefill_s, 4), "decode_s": round(self.decode_s, 4),
            "prefill_tokens_per_s": round(self.prefill_tokens_per_s, 2),
            "decode_tokens_per_s": round(self.decode_tokens_per_s, 2),
            "draft_s": round(self.draft_s, 4), "verify_s": round(self.verify_s, 4),
            "accept_s": round(self.accept_s, 4), "peak_memory_gb": round(self.peak_memory_gb, 3),
            "stop_reason": self.stop_reason, "discarded_tokens": self.discarded_tokens,
        }


def prefill(model: Model, prompt: list[int], cache: KVCache) -> tuple[mx.array, mx.array]:
    """Run the prompt at positions 0..n-1; return (g0, h): first predicted token (1,) and hidden (1, H)."""
    logits, hidden = model(mx.array([prompt]), cache, last_only=True)
    cache.advance(len(prompt))
    return mx.argmax(logits[:, -1], axis=-1), hidden[:, -1]


def ar_step(model: Model, token: mx.array, cache: KVCache) -> mx.array:
    """One autoregressive step (lazy): feed token (1,), return the target's next token (1,)."""
    logits, _ = model(token[:, None], cache)
    cache.advance(1)
    return mx.argmax(logits[:, -1], axis=-1)


class _Emitter:
    """Applies eos and max-token limits to the tokens a step produces."""

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


def generate_tokens(
    model: Model,
    prompt: list[int],
    *,
    drafter: Drafter | None = None,
    beam_width: int = 4,
    beam_length: int = 5,
    max_tokens: int = 256,
    eos_ids: list[int] = (),
    stats: Stats | None = None,
    cache: KVCache | None = None,
) -> Iterator[list[int]]:
    """Greedy decoding; ReDrafter when a drafter is given, else autoregressive. Yields new token ids.

    `cache` may be passed in (empty) to inspect it afterwards."""
    stats = stats if stats is not None else Stats()
    stats.prompt_tokens = len(prompt)
    W, L = beam_width, beam_length
    if cache is None:
        cache = KVCache(len(model.model.layers), len(prompt) + max_tokens + (W * L if drafter else 1))
    emit = _Emitter(stats, max_tokens, list(eos_ids))
    mx.reset_peak_memory()

    t0 = time.perf_counter()
    g0, h = prefill(model, prompt, cache)
    first = g0.item()
    stats.prefill_s = time.perf_counter() - t0
    out = emit([first])
    if out:
        yield out
    t_start = time.perf_counter()
    queued = None
    while not emit.done:
        if drafter is None:  # autoregressive step; the next one is queued before this one is read
            g0 = queued if queued is not None else ar_step(model, g0, cache)
            queued = ar_step(model, g0, cache) if stats.generated_tokens + 1 < max_tokens else None
            mx.async_eval(g0 if queued is None else queued)
            tokens = [g0.item()]
            stats.steps += 1
        else:
            t = time.perf_counter()
            beams, _ = beam_search(drafter, model.embed, h, g0, W, L)  # draft
            tree = pack(beams[0])  # pack (syncs once to learn the packed size)
            t_draft = time.perf_counter()
            positions = (cache.offset + tree.depth)[None]  # verify
            logits, hidden = model(tree.tokens[None], cache, positions, verify_mask(tree.mask, cache.offset))
            target_next = mx.argmax(logits[0], axis=-1)[tree.unpacker]  # (W, L) target's choice per slot
            best, n = accept_greedy(beams[0], target_next)  # accept
            path = tree.unpacker[best]  # (L,) packed indices along the best beam
            g0 = target_next[best, n][None]
            h = hidden[0, path[n]][None]
            drafted = beams[0, best]
            mx.eval(n, drafted, g0, h)
            t_verify = time.perf_counter()
            n_acc = n.item()
            tokens = drafted[1 : n_acc + 1].tolist() + [g0.item()]
            cache.commit(path, n_acc + 1)  # commit (lazy: evaluated with the next verify)
            stats.steps += 1
            stats.verified_tokens += tree.size
            stats.candidate_tokens += W * L
            stats.accepted_hist[n_acc] += 1
            stats.draft_s += t_draft - t
            stats.verify_s += t_verify - t_draft
            stats.accept_s += time.perf_counter() - t_verify
        out = emit(tokens)
        if out:
            yield out
    stats.decode_s = time.perf_counter() - t_start
    stats.peak_memory_gb = mx.get_peak_memory() / 1e9
