"""Reduced copies of a float32 drafter's weights that drafting reads on a CPU through our packed-weight product
(`system/packed_linear.py`): the bytes read per drafted token are the drafter's main cost there.

The kinds (`COPIES`, chosen by REDRAFTER_DRAFT_WEIGHTS; `auto` is `int8`):
- `int8`: 8-bit affine copies in groups of 64 (`mx.quantize`), a quarter of float32's bytes. A draft may differ
  from the float32 weights' where two tokens nearly tie; what is decoded never does (the target verifies every
  token). Measured with the shipped drafter on 16 held-out prompts: the same tokens per call as `float16` (default
  mode 2.05 vs 2.04, drafter alone 1.72 vs 1.71) at 1.04-1.07x its speed in the default mode and 1.06-1.08x
  drafting alone (AVX2 and AVX-512; bench/results/cpu-avx512/draft-weights-20261130/).
- `float16`: a copy of each weight that float16 holds exactly (the shipped drafter is stored so), at half float32's
  bytes: the drafts of the float32 weights (the sums may round differently in the last bit).
- `float32`: no copies: each layer's own product.
A copy serves while its layer still holds the weight it was made from (training replaces weights) and while the
kernel is usable; otherwise the layer's own product runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from mlx_redrafter.environment import named
from mlx_redrafter.model import held
from mlx_redrafter.system import packed_linear


@dataclass(frozen=True)
class CopyKind:
    """How a kind of copy is made: `bits` 16 (float16, only where it holds the weight exactly) or 4/8 (affine in
    groups of `group_size`); 0 makes none."""

    bits: int
    group_size: int = 0


COPIES = {"int8": CopyKind(8, 64), "float16": CopyKind(16), "float32": CopyKind(0)}
SWITCH = "REDRAFTER_DRAFT_WEIGHTS"


def chosen_kind() -> str:
    """The kind REDRAFTER_DRAFT_WEIGHTS names (`auto`: int8); UserError for an unknown value."""
    value = named(SWITCH)
    return "int8" if value == "auto" else value


class WeightCopy:
    """A float32 `nn.Linear`'s product from a reduced copy of its weight (float16, or affine `bits` with scales and
    biases)."""

    def __init__(self, layer: nn.Linear, weight: mx.array, scales: mx.array | None = None,
                 biases: mx.array | None = None, bits: int = 16, group_size: int = 0):
        self.layer, self.source = layer, layer.weight
        self.weight, self.scales, self.biases, self.bits, self.group_size = weight, scales, biases, bits, group_size
        self.bias = layer.get("bias")
        self.cuts: dict[int, tuple] = {}  # rows -> the first rows of (weight, scales, biases, bias), sliced once

    def current(self) -> bool:
        """The layer still holds the weight this copy was made from, and the kernel is usable."""
        return held([(self.layer, self.source)]) and packed_linear.usable()

    def __call__(self, x: mx.array, rows: int | None = None) -> mx.array:
        """x (..., K) -> (..., N) (the first `rows` outputs only: a head cut to its most frequent rows)."""
        weight, scales, biases, bias = self._parts(rows)
        if self.bits == 16:
            return packed_linear.half_product(x, weight, bias)
        return packed_linear.quantized_product(x, weight, scales, biases, self.bits, self.group_size, bias)

    def _parts(self, rows: int | None) -> tuple:
        parts = (self.weight, self.scales, self.biases, self.bias)
        if rows is None or rows >= self.weight.shape[0]:
            return parts
        if rows not in self.cuts:
            self.cuts[rows] = tuple(None if p is None else p[:rows] for p in parts)
        return self.cuts[rows]


def make_copy(layer: nn.Linear, kind: CopyKind) -> WeightCopy | None:
    """A copy of `layer`'s float32 weight of this kind, or None where the kind cannot hold it (float16: not
    exactly; affine: rows not a whole number of groups)."""
    w = layer.weight
    if kind.bits == 16:
        half = w.astype(mx.float16)
        return WeightCopy(layer, half) if mx.array_equal(half.astype(mx.float32), w).item() else None
    if kind.bits in (4, 8) and w.shape[-1] % kind.group_size == 0:
        q, scales, biases = mx.quantize(w, group_size=kind.group_size, bits=kind.bits)
        mx.eval(q, scales, biases)
        return WeightCopy(layer, q, scales, biases, kind.bits, kind.group_size)
    return None


def use_weight_copies(drafter: nn.Module, kind: str | None = None) -> int:
    """Give every float32 `nn.Linear` of `drafter` a copy of `kind` (default: `chosen_kind()`) where the kernel is
    usable (for decoding: the copies have no gradient); returns how many layers got one. Copies of another kind
    made before are dropped."""
    spec = COPIES[kind or chosen_kind()]
    if not packed_linear.usable():
        return 0
    count = 0
    for _, layer in drafter.named_modules():
        if type(layer) is not nn.Linear or layer.weight.dtype != mx.float32:
            continue
        copy = make_copy(layer, spec) if spec.bits else None
        layer.draft_copy = copy
        count += copy is not None
    return count


def current_copy(layer: nn.Module) -> WeightCopy | None:
    """The layer's copy where it has a current one (`WeightCopy.current`), else None."""
    copy = getattr(layer, "draft_copy", None)
    return copy if copy is not None and copy.current() else None


def copies_in_use(drafter: nn.Module) -> str:
    """What `drafter`'s linear layers draft from now: `int8`, `float16`, `float32` (no current copy) or `mixed`."""
    kinds = set()
    for _, layer in drafter.named_modules():
        if type(layer) is nn.Linear:
            copy = current_copy(layer)
            kinds.add("float32" if copy is None else "float16" if copy.bits == 16 else f"int{copy.bits}")
    return kinds.pop() if len(kinds) == 1 else ("mixed" if kinds else "float32")


def linear(layer: nn.Module, x: mx.array) -> mx.array:
    """layer(x), through the layer's copy where it has a current one."""
    copy = current_copy(layer)
    return layer(x) if copy is None else copy(x)
