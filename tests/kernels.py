"""Shared by the tests of our MLX extensions (`system/extension.py`): require one, or run without it."""

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from mlx_redrafter.system.blas import status
from mlx_redrafter.system.extension import Extension


def require(ext: Extension) -> None:
    """Fails where `ext` is expected and not active; skips elsewhere."""
    if not ext.active():
        if ext.expected:
            pytest.fail(f"{ext.what} is not active on a machine it is built for: {status().problem} "
                        "(make setup builds it)")
        pytest.skip(f"{ext.what} is not built for this machine")


@contextmanager
def without(ext: Extension) -> Iterator[None]:
    """MLX's own operations inside, where `ext` would run."""
    kept, ext.module = ext.module, None
    try:
        yield
    finally:
        ext.module = kept
