"""What differs between the transformers versions the PyTorch reference meets (this CPU's, a CUDA machine's)."""

from __future__ import annotations

import inspect
from typing import Any


def cache_kwarg(model: Any) -> str:
    """The keyword a model's forward takes its KV cache by: `cache` in recent transformers, `past_key_values` before
    (recent versions still take the old one, with a deprecation warning, until they drop it)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
