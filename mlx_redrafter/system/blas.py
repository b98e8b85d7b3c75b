"""Optimized BLAS for MLX's Linux CPU wheel.

The `mlx[cpu]` wheel links a slow reference BLAS. Loading Intel MKL (PyPI `mkl`) or OpenBLAS with
RTLD_GLOBAL before `mlx.core` is imported makes MLX's cblas calls resolve to the fast library.
Switch: REDRAFTER_BLAS=auto (default) | mkl | openblas | off.

On x86-64 with AVX-512 or AVX2 + FMA a small library of ours (csrc/smallgemm.c, built at install) is loaded first: its
cblas_sgemm computes the products of few rows (decode and verification steps) by streaming each weight once,
and hands everything else to the BLAS. Switch: REDRAFTER_SMALL_GEMM=auto (default) | off.
"""

from __future__ import annotations

import ctypes
import glob
import os
import platform
import sys
from collections.abc import Iterator
from contextlib import contextmanager

_loaded: str | None = None
_handle: ctypes.CDLL | None = None
_small: ctypes.CDLL | None = None


def _small_gemm_path() -> str | None:
    here = os.path.dirname(os.path.abspath(__file__))
    found = sorted(glob.glob(os.path.join(here, "_smallgemm*.so")))
    return os.environ.get("REDRAFTER_SMALL_GEMM_LIB") or (found[0] if found else None)


def _env_threads() -> int:
    for var in ("REDRAFTER_THREADS", "MKL_NUM_THREADS", "OMP_NUM_THREADS"):
        try:
            return max(1, int(os.environ[var]))
        except (KeyError, ValueError):
            continue
    return os.cpu_count() or 1


def _load_small_gemm() -> None:
    """Load the small-product library ahead of the BLAS (x86-64 Linux; silently skipped when unavailable)."""
    global _small
    if os.environ.get("REDRAFTER_SMALL_GEMM", "auto").lower() in ("off", "0", "none", "false"):
        return
    if platform.machine() not in ("x86_64", "AMD64"):
        return
    path = _small_gemm_path()
    if path is None:
        return
    try:
        _small = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError:
        _small = None


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
    if "mlx.core" in sys.modules:  # too late: MLX's BLAS symbols are already bound
        sys.stderr.write("redrafter-mlx: warning: mlx.core was imported before mlx_redrafter, so MLX keeps the "
                         "reference BLAS of its Linux wheel (decoding runs 3-15x slower); import mlx_redrafter "
                         "first (REDRAFTER_BLAS=off silences this)\n")
        return None
    _load_small_gemm()
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
            _small_falls_back_to(_handle)
            return _loaded
    _bundled_fallback()
    return None


def _small_falls_back_to(blas: ctypes.CDLL) -> None:
    """Hand the small-GEMM library (if loaded) the BLAS it passes every other product to."""
    if _small is not None:
        real = ctypes.cast(blas.cblas_sgemm, ctypes.c_void_p).value
        _small.redrafter_gemm_init(ctypes.c_void_p(real), ctypes.c_int(_env_threads()))


def _bundled_fallback() -> None:
    """No optimized BLAS: give the small-GEMM library the reference BLAS bundled with MLX's wheel for every
    other product (it cannot find it itself: MLX loads it privately)."""
    if _small is None:
        return
    import importlib.util

    spec = importlib.util.find_spec("mlx")
    roots = list(spec.submodule_search_locations or []) if spec else []
    for root in roots:
        for path in sorted(glob.glob(os.path.join(os.path.dirname(root), "mlx*.libs", "libblas*.so*"))):
            try:
                _small_falls_back_to(ctypes.CDLL(path))  # RTLD_LOCAL: MLX's own copy keeps serving MLX
            except OSError:
                continue
            return


def set_threads(n: int) -> bool:
    """Set the optimized BLAS's thread count at run time (MKL or OpenBLAS); False when there is none to set."""
    if _small is not None:
        _small.redrafter_gemm_set_threads(ctypes.c_int(n))
    for fn in ("MKL_Set_Num_Threads", "openblas_set_num_threads"):
        f = getattr(_handle, fn, None) if _handle is not None else None
        if f is not None:
            f(ctypes.c_int(n))
            return True
    return False


def blas_name() -> str:
    """Name of the BLAS MLX uses in this process (for reports)."""
    return (_loaded or "mlx-default") + ("+smallgemm" if _small is not None else "")


@contextmanager
def small_gemm_disabled() -> Iterator[None]:
    """Route every product to the BLAS while inside (e.g. to time another runtime as its users run it)."""
    if _small is not None:
        _small.redrafter_gemm_enable(ctypes.c_int(0))
    try:
        yield
    finally:
        if _small is not None:
            _small.redrafter_gemm_enable(ctypes.c_int(1))


def small_gemm_calls() -> tuple[int, int]:
    """(products our small-GEMM path computed, products it handed to the BLAS) so far; (0, 0) without it."""
    if _small is None:
        return 0, 0
    _small.redrafter_gemm_calls.restype = ctypes.c_long
    return _small.redrafter_gemm_calls(1), _small.redrafter_gemm_calls(0)
