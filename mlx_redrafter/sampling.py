"""The target's next-token distribution under sampling settings, shared by AR and speculative decoding.

`Sampling` holds what the user asked for (mlx-lm's names: temperature, top_p, top_k, min_p, seed); `probs`
turns target logits into the distribution every path samples from, so AR and speculative decoding sample
from exactly the same distribution. Filters apply in this order: temperature, top-k, top-p, min-p.
Temperature 0 means greedy (argmax).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mlx_redrafter.errors import UserError


@dataclass(frozen=True)
class Sampling:
    """Sampling settings; the default (temperature 0) is greedy decoding."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    accept: str | Callable[..., Any] = "exact"  # at T > 0: "exact", "typical", or a rule of your own:
    # fn(cands, tree, node_p, key) -> accept.Accepted (e.g. a deliberately biased rule to test the tests)
    typical_eps: float = 0.09  # Medusa's posterior_threshold
    typical_delta: float = 0.3  # Medusa's posterior_alpha

    def __post_init__(self) -> None:
        def number(value: Any, flag: str, ok: Callable[[float], bool], rule: str) -> None:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or not ok(value):
                raise UserError(f"{flag} must be a finite number {rule} (got {value!r})")

        number(self.temperature, "--temp", lambda v: v >= 0, ">= 0 (0 = greedy)")
        number(self.top_p, "--top-p", lambda v: 0 < v <= 1, "in (0, 1]")
        number(self.min_p, "--min-p", lambda v: 0 <= v < 1, "in [0, 1)")
        number(self.typical_eps, "--typical-eps", lambda v: 0 <= v <= 1, "in [0, 1]")
        number(self.typical_delta, "--typical-delta", lambda v: v >= 0, ">= 0")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise UserError(f"--top-k must be an integer >= 0 (0 = off; got {self.top_k!r})")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 1 << 63):
            raise UserError(f"--seed must be an integer from 0 to 2**63 - 1 (got {self.seed!r})")
        if not callable(self.accept) and self.accept not in ("exact", "typical"):
            raise UserError(f"--accept must be 'exact' or 'typical' (got {self.accept!r})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def as_dict(self) -> dict:
        d = {"temperature": self.temperature}
        if not self.greedy:
            d.update(top_p=self.top_p, top_k=self.top_k, min_p=self.min_p, seed=self.seed,
                     accept=self.accept if isinstance(self.accept, str) else getattr(self.accept, "__name__", "custom"))
            if self.accept == "typical":
                d.update(typical_eps=self.typical_eps, typical_delta=self.typical_delta)
        return d


GREEDY = Sampling()


def probs(logits: mx.array, s: Sampling) -> mx.array:
    """(..., V) logits -> (..., V) float32 probabilities of the filtered, tempered target distribution."""
    x = logits.astype(mx.float32) / s.temperature
    if s.top_k and s.top_k < x.shape[-1]:
        kth = mx.min(mx.topk(x, s.top_k, axis=-1), axis=-1, keepdims=True)
        x = mx.where(x < kth, -mx.inf, x)
    if s.top_p < 1.0:
        order = mx.argsort(-x, axis=-1)
        p_sorted = mx.softmax(mx.take_along_axis(x, order, axis=-1), axis=-1, precise=True)
        before = mx.cumsum(p_sorted, axis=-1) - p_sorted  # mass of the tokens ranked above
        drop_sorted = before >= s.top_p  # keep the smallest prefix whose mass reaches top_p
        drop = mx.put_along_axis(mx.zeros_like(drop_sorted), order, drop_sorted, axis=-1)
        x = mx.where(drop, -mx.inf, x)
    p = mx.softmax(x, axis=-1, precise=True)
    if s.min_p > 0:
        p = mx.where(p < s.min_p * mx.max(p, axis=-1, keepdims=True), 0.0, p)
        p = p / p.sum(axis=-1, keepdims=True)
    return p


class Rng:
    """A stream of MLX random keys: seeded runs are reproducible, unseeded ones differ."""

    def __init__(self, seed: int | None):
        self.key = mx.random.key(seed if seed is not None else int.from_bytes(os.urandom(4), "little"))

    def next(self) -> mx.array:
        self.key, sub = mx.random.split(self.key)
        return sub


def sample(p: mx.array, key: mx.array) -> mx.array:
    """One token per row of probabilities (..., V) -> (...) int32 (Gumbel-max; zero-probability tokens never)."""
    return mx.random.categorical(mx.log(p), key=key).astype(mx.int32)


def next_token(logits: mx.array, s: Sampling, rng: Rng | None) -> mx.array:
    """The target's next token from logits (..., V): argmax when greedy, else a sample of `probs`."""
    if s.greedy:
        return mx.argmax(logits, axis=-1).astype(mx.int32)
    return sample(probs(logits, s), rng.next())
