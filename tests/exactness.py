"""Shared by the exactness tests and `make fuzz`: run AR and speculative decoding, compare token ids."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from bench.agreement import FP32_TIE, compare
from mlx_redrafter.draft.base import Allocator
from mlx_redrafter.generate import Stats, collect, generate_ar, generate_speculative

TIE = FP32_TIE  # a fp32 divergence is tolerated only on a numerical tie of the AR path (top-2 gap < 1e-4)


def ar_tokens(model, prompt: list[int], max_tokens: int, eos_ids: list[int]) -> list[int]:
    return collect(generate_ar(model, prompt, max_tokens=max_tokens, eos_ids=eos_ids))[0]


def speculative_tokens(model, prompt: list[int], allocator: Allocator, length: int, max_tokens: int,
                       eos_ids: list[int]) -> tuple[list[int], Stats]:
    return collect(generate_speculative(model, prompt, allocator, length=length, max_tokens=max_tokens,
                                        eos_ids=eos_ids))


def divergence(model, prompt: list[int], ar: list[int], got: list[int]) -> str | None:
    """None if equal (or a proven tie explains the first difference), else a message. The rule lives in
    `bench.agreement` (float32: AR top-2 gap below TIE; float16 / bfloat16 / quantized: a measured
    multiple of the dtype's rounding)."""
    return compare(model, prompt, ar, got).problem()


@contextmanager
def reading_layers(model, layers: tuple[int, ...]) -> Iterator[None]:
    """The model's forward returns `layers` beside its last state inside the block (none: the last state alone),
    then what it returned before: the session's target may be paired with a drafter that fuses layers."""
    kept = model.feature_layers
    model.feature_layers = tuple(layers)
    try:
        yield
    finally:
        model.feature_layers = kept
