"""What differs between the transformers versions the PyTorch reference meets (this CPU's, a CUDA machine's)."""

from __future__ import annotations

import inspect
from functools import cache
from typing import Any


def cache_kwarg(model: Any) -> str:
    """The keyword a model's forward takes its KV cache by: `cache` in recent transformers, `past_key_values` before
    (recent versions still take the old one, with a deprecation warning, until they drop it)."""
    return _cache_kwarg(type(model))


@cache
def _cache_kwarg(cls: type) -> str:  # read once per model class, not at every forward
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"
