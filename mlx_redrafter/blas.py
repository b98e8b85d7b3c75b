"""Optimized BLAS for MLX's Linux CPU wheel.

The `mlx[cpu]` wheel links a slow reference BLAS. Loading Intel MKL (PyPI `mkl`) or OpenBLAS with
RTLD_GLOBAL before `mlx.core` is imported makes MLX's cblas calls resolve to the fast library.
Switch: REDRAFTER_BLAS=auto (default) | mkl | openblas | off.
"""

from __future__ import annotations

import ctypes
import glob
import os
import platform
import sys

_loaded: str | None = None
_handle: ctypes.CDLL | None = None


def _mkl_candidates() -> list[str]:
    dirs = [os.path.join(sys.prefix, "lib"), os.path.join(sys.base_prefix, "lib")]
    found: list[str] = []
    for d in dirs:
        found += sorted(glob.glob(os.path.join(d, "libmkl_rt.so*")), reverse=True)
    return found


def _openblas_candidates() -> list[str]:
    return ["libopenblas.so.0", "libopenblas.so"]


def load_optimized_blas() -> str | None:
    """Preload an optimized BLAS on Linux before MLX starts; return the library loaded (or None)."""
    global _loaded, _handle
    if _loaded is not None:
        return _loaded
    choice = os.environ.get("REDRAFTER_BLAS", "auto").lower()
    if choice in ("off", "0", "none", "false") or platform.system() != "Linux":
        return None
    if "mlx.core" in sys.modules:
        # Too late: MLX's BLAS symbols are already bound.
        return None
    order = {"auto": ["mkl", "openblas"], "mkl": ["mkl"], "openblas": ["openblas"]}.get(choice, [])
    for kind in order:
        if kind == "mkl":
            os.environ.setdefault("MKL_THREADING_LAYER", "GNU")
            paths = _mkl_candidates()
        else:
            paths = _openblas_candidates()
        for path in paths:
            try:
                _handle = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
            _loaded = os.path.basename(path)
            return _loaded
    return None


def set_threads(n: int) -> bool:
    """Set the optimized BLAS's thread count at run time (MKL or OpenBLAS); False when there is none to set."""
    for fn in ("MKL_Set_Num_Threads", "openblas_set_num_threads"):
        f = getattr(_handle, fn, None) if _handle is not None else None
        if f is not None:
            f(ctypes.c_int(n))
            return True
    return False


def blas_name() -> str:
    """Name of the BLAS MLX uses in this process (for reports)."""
    return _loaded or "mlx-default"
