"""Shared by the exactness tests and `make fuzz`: run AR and speculative decoding, compare token ids."""

from __future__ import annotations

import mlx.core as mx

from mlx_redrafter.generate import Stats, generate_ar, generate_speculative
from mlx_redrafter.sources import Allocator

TIE = 1e-4  # DESIGN §4: a fp32 divergence is tolerated only on a numerical tie of the AR path


def ar_tokens(model, prompt: list[int], max_tokens: int, eos_ids: list[int]) -> list[int]:
    return sum(generate_ar(model, prompt, max_tokens=max_tokens, eos_ids=eos_ids), [])


def speculative_tokens(model, prompt: list[int], allocator: Allocator, length: int, max_tokens: int,
                       eos_ids: list[int], stats: Stats | None = None) -> list[int]:
    return sum(generate_speculative(model, prompt, allocator, length=length, max_tokens=max_tokens, eos_ids=eos_ids,
                                    stats=stats), [])


def divergence(model, prompt: list[int], ar: list[int], got: list[int]) -> str | None:
    """None if equal (or a proven tie explains the first difference), else a message."""
    if got == ar:
        return None
    i = next((j for j, (a, b) in enumerate(zip(ar, got)) if a != b), min(len(ar), len(got)))
    seq = prompt + ar[:i]
    logits, _ = model(mx.array([seq]), model.make_cache(len(seq)), last_only=True)
    top2 = mx.sort(logits[0, -1])[-2:]
    gap = (top2[1] - top2[0]).item()
    return None if gap < TIE else f"diverged from AR at token {i} with top-2 logit gap {gap:.2e} (not a tie)"
