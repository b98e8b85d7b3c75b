"""Float16 copies of a float32 drafter's weights, for drafting on a CPU with our packed-weight product
(`system/packed_linear.py`: half the bytes read per drafted token, the drafter's main cost there).

Only a weight that float16 holds exactly gets a copy, so a drafter drafts what its float32 weights draft (the sums
may round differently in the last bit). A copy serves while its layer still holds the weight it was made from
(training replaces weights) and while the kernel is usable; otherwise the layer's own product runs.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlx_redrafter.model import held
from mlx_redrafter.system import packed_linear


class HalfWeights:
    """A float32 `nn.Linear`'s product from a float16 copy of its weight."""

    def __init__(self, layer: nn.Linear, weight: mx.array):
        self.layer, self.source, self.weight = layer, layer.weight, weight
        self.bias = layer.get("bias")

    def current(self) -> bool:
        """The layer still holds the weight this copy was made from, and the kernel is usable."""
        return held([(self.layer, self.source)]) and packed_linear.usable()

    def __call__(self, x: mx.array, rows: int | None = None) -> mx.array:
        """x (..., K) -> (..., N) (the first `rows` outputs only: a head cut to its most frequent rows)."""
        if rows is None:
            return packed_linear.half_product(x, self.weight, self.bias)
        return packed_linear.half_product(x, self.weight[:rows], None if self.bias is None else self.bias[:rows])


def linear(layer: nn.Module, x: mx.array) -> mx.array:
    """layer(x), through the layer's float16 copy where it has a current one."""
    half = getattr(layer, "half", None)
    return half(x) if half is not None and half.current() else layer(x)


def use_half_weights(drafter: nn.Module) -> int:
    """Give every float32 `nn.Linear` of `drafter` whose weight float16 holds exactly a float16 copy, where the
    kernel is usable (for decoding: the copies have no gradient); returns how many layers got one."""
    if not packed_linear.usable():
        return 0
    count = 0
    for _, layer in drafter.named_modules():
        if type(layer) is not nn.Linear or layer.weight.dtype != mx.float32:
            continue
        half = layer.weight.astype(mx.float16)
        if mx.array_equal(half.astype(mx.float32), layer.weight).item():
            layer.half = HalfWeights(layer, half)
            count += 1
    return count
