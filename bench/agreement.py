"""Agreement of speculative and autoregressive greedy output in any dtype, with the tie-aware rule.

Greedy speculative decoding decides every token with the target's argmax, like AR decoding, but a packed
verification block sums in another order than a one-token step. In float32 the two agree to ~1e-6 and the
outputs are identical; in float16 / bfloat16 (and with quantized weights, whose activations are float16) a
near-tie of the top-2 logits may flip. The rule: at the first differing token, take the AR path's
top-2 logit gap (one full forward of the same model over prompt + common prefix) and call the divergence real
only where the gap exceeds what the dtype's rounding explains:

    bound(dtype) = TIE_FACTOR[dtype] * EPSILON[dtype] * max |logit|     (float32: an absolute 1e-4)

EPSILON is the unit roundoff of the activation dtype. TIE_FACTOR is measured, not guessed (`python -m bench
dtype-agreement`, bench/results/cpu/dtype-agreement/): the same tokens' logits computed one token at a time, in
verify-sized blocks and in one full forward differ by at most ~C * EPSILON * max |logit|; a flip needs the two
paths' top-2 differences to disagree in sign, so the gap seen by the full forward stays below 2 * (C_block +
C_full) * EPSILON * max |logit|; TIE_FACTOR rounds that up with a margin. The report lists the largest gap at
which a flip was ever observed against this bound.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from mlx_redrafter.model import Model
from mlx_redrafter.models.loader import Target, apply_template, build_model, pick_dtype, read_checkpoint, resolve_model

FP32_TIE = 1e-4  # absolute top-2 gap of the AR path below which a float32 divergence is a numerical tie
EPSILON = {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}  # unit roundoff (half machine epsilon)
# Multiples of EPSILON * max|logit| (measured in bench/results/cpu/dtype-agreement/, see the module docstring).
TIE_FACTOR = {"float16": 64.0, "bfloat16": 64.0}


def dtype_name(model: Model) -> str:
    """'float32' / 'float16' / 'bfloat16': the model's activation dtype (float16 for quantized weights)."""
    return str(model.dtype).rsplit(".", 1)[-1]


def tie_bound(dtype: str, scale: float) -> float:
    """Largest AR top-2 logit gap that rounding in `dtype` explains, for logits of magnitude `scale`."""
    if dtype == "float32":
        return FP32_TIE
    return TIE_FACTOR[dtype] * EPSILON[dtype] * scale


def top2_gap(model: Model, seq: list[int]) -> tuple[float, float]:
    """(top-1 minus top-2 logit, max |logit|) of the next token after `seq`: one full forward, float32 maths."""
    logits, _ = model(mx.array([seq]), model.make_cache(len(seq)), last_only=True)
    row = logits[0, -1].astype(mx.float32)
    top2 = mx.sort(row)[-2:]
    gap, scale = top2[1] - top2[0], mx.abs(row).max()
    mx.eval(gap, scale)
    return gap.item(), scale.item()


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where `a` and `b` differ (a length difference counts); None if equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@dataclass
class Agreement:
    """How a speculative output compares with the AR output of the same model and dtype."""

    dtype: str
    tokens: int  # max(len(ar), len(got))
    matched: int  # common prefix length
    first_diff: int | None = None  # index of the first differing token
    gap: float | None = None  # AR path's top-2 logit gap there
    scale: float | None = None  # max |logit| there
    bound: float | None = None  # tie_bound(dtype, scale)

    @property
    def equal(self) -> bool:
        return self.first_diff is None

    @property
    def tie(self) -> bool:
        """Diverged on a near-tie that the dtype's rounding explains."""
        return self.first_diff is not None and self.gap is not None and self.gap <= self.bound

    @property
    def real(self) -> bool:
        """Diverged where the AR path had a clear winner: a bug, not rounding."""
        return self.first_diff is not None and not self.tie

    @property
    def match_rate(self) -> float:
        """Common prefix / longer length (1.0 when equal)."""
        return self.matched / self.tokens if self.tokens else 1.0

    def problem(self) -> str | None:
        """None unless the divergence is real; then a one-line message."""
        if not self.real:
            return None
        return (f"{self.dtype}: diverged from AR at token {self.first_diff} with top-2 logit gap {self.gap:.3g} > "
                f"tie bound {self.bound:.3g} (not a tie)")

    def as_dict(self) -> dict:
        return {"dtype": self.dtype, "tokens": self.tokens, "matched": self.matched,
                "match_rate": round(self.match_rate, 4), "first_diff": self.first_diff, "gap": self.gap,
                "scale": self.scale, "bound": self.bound, "tie": self.tie, "real": self.real}


def compare(model: Model, prompt: list[int], ar: list[int], got: list[int]) -> Agreement:
    """Compare `got` with `ar` (both greedy continuations of `prompt` by `model`) under the tie-aware rule.

    A divergence after AR stopped (AR's eos or length) is judged at that position as well: the AR path's gap
    decides whether the other continuation was a near-tie."""
    dtype = dtype_name(model)
    i = first_difference(ar, got)
    res = Agreement(dtype=dtype, tokens=max(len(ar), len(got)), matched=len(ar) if i is None else i)
    if i is not None:
        res.first_diff = i
        res.gap, res.scale = top2_gap(model, prompt + ar[:i])
        res.bound = tie_bound(dtype, res.scale)
    return res


def load_first_layers(spec: str | None, n: int, dtype: str) -> Target:
    """Load a target keeping only its first `n` transformer layers (final norm and head kept), through the
    loader's own code path for `dtype`: a cheap stand-in for slow dtypes on a CPU backend (tests)."""
    name, path = resolve_model(spec)
    cfg, weights, quant, tokenizer = read_checkpoint(path)
    apply_template(tokenizer, name, path, cfg)

    def kept(key: str) -> bool:
        return not key.startswith("model.layers.") or int(key.split(".")[2]) < n

    weights = {k: v for k, v in weights.items() if kept(k)}
    quant = {k: q for k, q in quant.items() if kept(k)}
    chosen = pick_dtype(dtype, bool(quant))
    model = build_model({**cfg, "num_hidden_layers": n}, weights, quant, chosen)
    return Target(model=model, tokenizer=tokenizer, name=name, path=path, dtype=chosen)
