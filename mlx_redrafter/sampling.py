"""The target's next-token distribution under sampling settings, shared by AR and speculative decoding.

`Sampling` holds what the user asked for (mlx-lm's names: temperature, top_p, top_k, min_p, seed, logit_bias and
the repetition/presence/frequency penalties). `adjust` gives the logits every choice reads (the bias, then the
penalties on each row's own recent tokens: penalties.py), and `probs` turns them into the distribution every path
samples from, so AR and speculative decoding choose from exactly the same distribution. Filters apply in this
order: temperature, top-k, top-p, min-p. Temperature 0 means greedy (argmax).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mlx_redrafter.errors import UserError
from mlx_redrafter.penalties import penalize, window


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
    logit_bias: Any = ()  # added to the target's logits before any choice, greedy included: ((token id, bias), ...),
    # or given as a {id: bias} mapping or "ID=BIAS,ID=BIAS" text (normalised to sorted pairs)
    # Penalties on the tokens of the last *_context_size tokens (prompt included), mlx-lm's: repetition divides a
    # positive logit by the penalty and multiplies a negative one (0 or 1 = off); presence subtracts the penalty
    # once, frequency once per occurrence (0 = off). Greedy included (penalties.py).
    repetition_penalty: float = 0.0
    repetition_context_size: int = 20
    presence_penalty: float = 0.0
    presence_context_size: int = 20
    frequency_penalty: float = 0.0
    frequency_context_size: int = 20

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
        object.__setattr__(self, "logit_bias", bias_pairs(self.logit_bias))
        number(self.repetition_penalty, "--repetition-penalty", lambda v: 0 <= v <= MAX_REPETITION_PENALTY,
               f"from 0 to {MAX_REPETITION_PENALTY:g} (0 or 1 = off)")
        for kind in ("presence", "frequency"):
            number(getattr(self, f"{kind}_penalty"), f"--{kind}-penalty", lambda v: abs(v) <= 2, "from -2 to 2")
        for kind in PENALTIES:
            size = getattr(self, f"{kind}_context_size")
            if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= MAX_PENALTY_CONTEXT:
                raise UserError(f"--{kind}-context-size must be an integer from 1 to {MAX_PENALTY_CONTEXT} "
                                f"(got {size!r})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalties(self) -> tuple[tuple[str, float, int], ...]:
        """The penalties in use, in the order they apply: (kind, penalty, context size)."""
        return tuple((k, float(getattr(self, f"{k}_penalty")), getattr(self, f"{k}_context_size"))
                     for k in PENALTIES if getattr(self, f"{k}_penalty") not in PENALTY_OFF[k])

    @property
    def recent_size(self) -> int:
        """How many of the latest tokens the penalties read (0: none in use)."""
        return max((size for _, _, size in self.penalties), default=0)

    def as_dict(self) -> dict:
        d = {"temperature": self.temperature}
        if not self.greedy:
            d.update(top_p=self.top_p, top_k=self.top_k, min_p=self.min_p, seed=self.seed,
                     accept=self.accept if isinstance(self.accept, str) else getattr(self.accept, "__name__", "custom"))
            if self.accept == "typical":
                d.update(typical_eps=self.typical_eps, typical_delta=self.typical_delta)
        if self.logit_bias:
            d["logit_bias"] = {str(t): b for t, b in self.logit_bias}
        for kind, penalty, size in self.penalties:
            d.update({f"{kind}_penalty": penalty, f"{kind}_context_size": size})
        return d


PENALTIES = ("repetition", "presence", "frequency")  # in the order they apply (mlx-lm's), after the logit bias
PENALTY_OFF = {"repetition": (0.0, 1.0), "presence": (0.0,), "frequency": (0.0,)}  # values that change nothing
MAX_REPETITION_PENALTY = 10.0
MAX_PENALTY_CONTEXT = 4096  # tokens a penalty may look back


MAX_LOGIT_BIAS = 100.0  # OpenAI's range: -100 bans a token, +100 all but forces it
LOGIT_BIAS_HELP = 'token ids with a bias from -100 to 100 each: ID=BIAS,ID=BIAS (in a request, {"ID": BIAS})'


def bias_pairs(value: Any) -> tuple[tuple[int, float], ...]:
    """A logit bias as sorted ((token id, bias), ...): from pairs, a {id: bias} mapping (ids may be strings of
    digits, as in JSON) or "ID=BIAS,ID=BIAS" text. One-line UserError for anything else."""
    def bad(why: str) -> UserError:
        return UserError(f"--logit-bias: {why}: give {LOGIT_BIAS_HELP}")

    if isinstance(value, str):
        items = []
        for part in (p.strip() for p in value.split(",")):
            if part:
                key, eq, bias = part.partition("=")
                if not eq:
                    raise bad(f"{part!r} is not ID=BIAS")
                items.append((key.strip(), bias.strip()))
    elif isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, (tuple, list)):
        items = list(value)
    else:
        raise bad(f"got {type(value).__name__}")
    out: dict[int, float] = {}
    for item in items:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise bad(f"{item!r} is not an (id, bias) pair")
        key, bias = item
        try:
            tid = key if isinstance(key, int) and not isinstance(key, bool) else int(str(key), 10)
        except ValueError:
            raise bad(f"token id {key!r} is not an integer") from None
        if isinstance(bias, str):
            try:
                bias = float(bias)
            except ValueError:
                raise bad(f"bias {bias!r} of token {tid} is not a number") from None
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias) \
                or abs(bias) > MAX_LOGIT_BIAS:
            raise bad(f"bias {bias!r} of token {tid} is not a number from -100 to 100")
        if tid < 0:
            raise bad(f"token id {tid} is negative")
        if tid in out:
            raise bad(f"token {tid} is given twice")
        out[tid] = float(bias)
    return tuple(sorted(out.items()))


GREEDY = Sampling()


@functools.lru_cache(maxsize=8)
def _bias_vector(pairs: tuple[tuple[int, float], ...], vocab: int) -> mx.array:
    ids, values = zip(*pairs)
    return mx.zeros((vocab,), mx.float32).at[mx.array(ids)].add(mx.array(values, mx.float32))


def biased(logits: mx.array, s: Sampling) -> mx.array:
    """(..., V) logits with the settings' logit bias added (as they are without one): what every choice reads,
    so AR and speculative decoding choose from the same biased logits. One-line UserError for an id outside
    the vocabulary."""
    if not s.logit_bias:
        return logits
    check_bias_ids(s, logits.shape[-1])
    return logits.astype(mx.float32) + _bias_vector(s.logit_bias, logits.shape[-1])


def check_bias_ids(s: Sampling, vocab: int) -> None:
    """One-line UserError unless every logit-bias token id is inside a vocabulary of `vocab` tokens."""
    if s.logit_bias and s.logit_bias[-1][0] >= vocab:
        raise UserError(f"--logit-bias: token id {s.logit_bias[-1][0]} is outside the model's vocabulary of {vocab} "
                        f"tokens")


def adjust(logits: mx.array, s: Sampling, recent: mx.array | None = None, tree: Any = None,
           allowed: mx.array | None = None) -> mx.array:
    """(rows, V) logits as every choice reads them (`next_token`, `accept`): the logit bias added, then the penalties
    on recent tokens (mlx-lm's order), then the tokens a grammar forbids at -inf (`allowed`: (rows, V) bool,
    constraint.py); as they are when none is set. `recent` (the latest `s.recent_size` tokens or more) and `tree`
    (one row per node) as in `penalties.penalize`; needed only with a penalty (lazy)."""
    x = biased(logits, s)
    x = penalize(x.astype(mx.float32), s.penalties, recent, tree) if s.penalties else x
    return x if allowed is None else mx.where(allowed, x, -mx.inf)


def recent_tokens(tokens: list[int], s: Sampling) -> mx.array | None:
    """What `adjust` needs of a sequence's tokens: the latest ones its penalties read (None without penalties)."""
    return window(tokens, s.recent_size) if s.penalties else None


def probs(logits: mx.array, s: Sampling) -> mx.array:
    """(..., V) logits (as `adjust` gives them) -> (..., V) float32 probabilities of the filtered, tempered target
    distribution."""
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
    """The target's next token from logits (..., V) as `adjust` gives them: argmax when greedy, else a sample of
    `probs`."""
    if s.greedy:
        return mx.argmax(logits, axis=-1).astype(mx.int32)
    return sample(probs(logits, s), rng.next())
