"""Optimized BLAS for MLX's Linux CPU wheel, installed explicitly by entry points (`install`).

The `mlx[cpu]` wheel links a slow reference BLAS. Loading Intel MKL (PyPI `mkl`) or OpenBLAS with
RTLD_GLOBAL before `mlx.core` is imported makes MLX's cblas calls resolve to the fast library.
Switch: REDRAFTER_BLAS=auto (default) | mkl | openblas | off.

On x86-64 with AVX-512 or AVX2 + FMA a small library of ours (csrc/smallgemm.c, built at install) is loaded first: its
cblas_sgemm computes the products of few rows (decode and verification steps) by streaming each weight once,
and hands everything else to the BLAS (MLX's bundled one when REDRAFTER_BLAS=off).
Switch: REDRAFTER_SMALL_GEMM=auto (default) | off.
Then our MLX primitives are loaded (`system/extension.py`; each checked against MLX's own operations): the attention
kernel (attention_kernel.py; REDRAFTER_ATTENTION_KERNEL=auto | off), our packed-weight products
(packed_linear.py; REDRAFTER_PACKED_WEIGHTS=auto | off) and log-sum-exp over logits (vector_math.py;
REDRAFTER_VECTOR_MATH=auto | off).
Other values of any switch are refused (a UserError naming the variable and the values it takes).

Importing this package changes nothing: the command line, the benchmark and the tests call `install()` before
anything imports mlx.core; a Python program does the same (`mlx_redrafter.install_blas()`). `install` checks a
tiny product of each path against numpy and says in one line on stderr when the kernel was expected on this
machine but is not active.
"""

from __future__ import annotations

import ctypes
import glob
import os
import platform
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from types import ModuleType

from mlx_redrafter.environment import check_named, number, switch
from mlx_redrafter.system import attention_kernel, packed_linear, vector_math

_loaded: str | None = None
_handle: ctypes.CDLL | None = None
_small: ctypes.CDLL | None = None
_OFF = ("off", "0", "none", "false")
_ON = ("auto", "on", "1", "true")
BLAS_CHOICES = ("auto", "mkl", "openblas", *_OFF)
SMALL_GEMM_CHOICES = (*_ON, *_OFF)
KERNEL_CHOICES = ("auto", *_OFF, *_ON[1:])  # the switch of each of our MLX primitives


@dataclass
class BlasStatus:
    """What `install` did: the BLAS MLX uses, whether the small-GEMM kernel is active, and why not if it was
    expected (x86-64 Linux with AVX-512 or AVX2 + FMA, switch not off)."""

    installed: bool = False
    blas: str = "mlx-default"  # the library's file name, or mlx-default (the wheel's reference BLAS)
    small_gemm: bool = False
    small_gemm_version: int = 0  # the kernel build's version (its speed; see csrc/smallgemm.c)
    small_gemm_expected: bool = False
    attention_kernel: bool = False  # our CPU attention kernel (attention_kernel.py) is active
    packed_weights: bool = False  # our packed-weight products (packed_linear.py) are active
    vector_math: bool = False  # our vector-math kernels (vector_math.py) are active
    problem: str = ""  # why an expected piece is missing, or what the self-check found

    def describe(self) -> str:
        """E.g. 'libmkl_rt.so.2+smallgemm6+attn1' (each kernel's version after its name; the GEMM's from 2)."""
        name = self.blas
        if self.small_gemm:
            name += "+smallgemm" + (str(self.small_gemm_version) if self.small_gemm_version > 1 else "")
        for k in KERNELS:
            if getattr(self, k.field):
                name += f"+{k.tag}{k.module.VERSION}"
        return name

    def as_dict(self) -> dict:
        """All fields, for --json output and benchmark records."""
        return asdict(self)


@dataclass(frozen=True)
class Kernel:
    """One of our MLX primitives as `install` loads it: its module (with `KERNEL`, `VERSION` and `load`), its switch,
    its `BlasStatus` field and tag, what runs slower without it, and the CPU flags one of which it needs beside
    AVX-512F or AVX2 + FMA (none: those alone)."""

    module: ModuleType
    switch: str
    field: str
    tag: str
    slower: str
    needs_any: frozenset[str] = frozenset()

    def requested(self) -> bool:
        """Its switch is on (auto, the default) rather than off."""
        return switch(self.switch, KERNEL_CHOICES) not in _OFF


KERNELS = (
    Kernel(attention_kernel, "REDRAFTER_ATTENTION_KERNEL", "attention_kernel", "attn",
           "attention runs on MLX's operations, slower"),
    Kernel(packed_linear, "REDRAFTER_PACKED_WEIGHTS", "packed_weights", "packed",
           "weight products run on float32 copies, slower", frozenset({"avx512f", "f16c"})),
    Kernel(vector_math, "REDRAFTER_VECTOR_MATH", "vector_math", "vmath",
           "drafter training and the feature pass run MLX's exp, slower"),
)

_status = BlasStatus()


def blas_choice() -> str:
    """REDRAFTER_BLAS: 'auto', 'mkl', 'openblas' or 'off' (any of its spellings maps to 'off')."""
    value = switch("REDRAFTER_BLAS", BLAS_CHOICES)
    return "off" if value in _OFF else value


def small_gemm_requested() -> bool:
    """REDRAFTER_SMALL_GEMM is on (auto, the default) rather than off."""
    return switch("REDRAFTER_SMALL_GEMM", SMALL_GEMM_CHOICES) not in _OFF


def _small_gemm_path() -> str | None:
    here = os.path.dirname(os.path.abspath(__file__))
    found = sorted(glob.glob(os.path.join(here, "_smallgemm*.so")))
    return os.environ.get("REDRAFTER_SMALL_GEMM_LIB") or (found[0] if found else None)


def _env_threads() -> int:
    """REDRAFTER_THREADS (a whole number >= 1), else MKL's or OpenMP's thread count, else one per core."""
    ours = int(number("REDRAFTER_THREADS", 0, 1, integer=True))
    if ours:
        return ours
    for var in ("MKL_NUM_THREADS", "OMP_NUM_THREADS"):  # theirs: their libraries judge their values
        try:
            return max(1, int(os.environ[var]))
        except (KeyError, ValueError):
            continue
    return os.cpu_count() or 1


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux lists them in /proc/cpuinfo ('flags' on x86, 'Features' on Arm); empty
    where there is no such file."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith(("flags", "Features"))),
                        set())
    except OSError:
        return set()


def _cpu_has_kernel_features() -> bool:
    """AVX-512F, or AVX2 and FMA (what the kernel is built for)."""
    flags = cpu_flags()
    return "avx512f" in flags or {"avx2", "fma"} <= flags


SMALL_GEMM_SYMBOLS = ("redrafter_gemm_version", "redrafter_gemm_enable", "redrafter_gemm_init",
                      "redrafter_gemm_set_threads", "redrafter_gemm_use_avx512", "redrafter_gemm_calls")


def _load_small_gemm() -> str:
    """Load the small-product library ahead of the BLAS (x86-64 Linux); returns why it is not loaded ('' if it is)."""
    global _small
    path = _small_gemm_path()
    if path is None:
        return "its library (mlx_redrafter/system/_smallgemm*.so) is not built"
    if not os.path.exists(path):
        return f"its library {path} does not exist"
    try:
        _small = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        _small = None
        return f"its library {path} does not load ({e})"
    missing = [name for name in SMALL_GEMM_SYMBOLS if not hasattr(_small, name)]
    if missing:  # another library than ours (REDRAFTER_SMALL_GEMM_LIB), or a build from another version
        _small = None
        return f"its library {path} is not the small-GEMM kernel (it lacks {', '.join(missing)})"
    return ""


def _mkl_candidates() -> list[str]:
    dirs = [os.path.join(sys.prefix, "lib"), os.path.join(sys.base_prefix, "lib")]
    found: list[str] = []
    for d in dirs:
        found += sorted(glob.glob(os.path.join(d, "libmkl_rt.so*")), reverse=True)
    return found


def _openblas_candidates() -> list[str]:
    return ["libopenblas.so.0", "libopenblas.so"]


def check_switches() -> tuple[str, bool, list[Kernel]]:
    """The BLAS choice, whether the small-GEMM kernel is wanted and the kernels switched on, read from the
    environment without loading anything; a UserError naming the first switch with an unknown value (or a malformed
    REDRAFTER_THREADS, or one of the switches `environment.NAMED` lists)."""
    _env_threads()
    check_named()
    return blas_choice(), small_gemm_requested(), [k for k in KERNELS if k.requested()]


def install() -> BlasStatus:
    """Load the optimized BLAS and the small-GEMM kernel (per the switches) before MLX starts, check them on a
    tiny product, and return what is in use. Idempotent; call it before anything imports mlx.core.
    Raises UserError for an unknown value of either switch."""
    global _status
    if _status.installed:
        return _status
    choice, want_small, wanted = check_switches()  # unknown switch values fail before anything loads
    st = BlasStatus(installed=True)
    if platform.system() != "Linux":
        _status = st
        return st
    if "mlx.core" in sys.modules:  # too late: MLX's BLAS symbols are already bound
        st.problem = "mlx.core was imported before the BLAS was installed"
        sys.stderr.write("warning: mlx.core was imported before mlx_redrafter.install_blas(), so MLX keeps the "
                         "reference BLAS of its Linux wheel (decoding runs 3-15x slower); call install_blas() "
                         "first (REDRAFTER_BLAS=off REDRAFTER_SMALL_GEMM=off silences this)\n")
        _status = st
        return st
    x86 = platform.machine() in ("x86_64", "AMD64")
    if want_small and x86:
        st.small_gemm_expected = _cpu_has_kernel_features()
        missing = _load_small_gemm()
        if missing and st.small_gemm_expected:
            st.problem = f"the small-GEMM kernel is not active: {missing}"
    order = {"auto": ["mkl", "openblas"], "mkl": ["mkl"], "openblas": ["openblas"]}.get(choice, [])
    for kind in order:
        paths = _mkl_candidates() if kind == "mkl" else _openblas_candidates()
        if kind == "mkl":
            os.environ.setdefault("MKL_THREADING_LAYER", "GNU")
        if _load_blas(paths):
            break
    if _handle is None:
        _bundled_fallback()
    st.blas, st.small_gemm = _loaded or "mlx-default", _small is not None
    if _small is not None:
        st.small_gemm_version = _small.redrafter_gemm_version() if hasattr(_small, "redrafter_gemm_version") else 1
    _self_check(st)
    slower = fix = ""
    for k in wanted:
        expected = x86 and _cpu_has_kernel_features() and (not k.needs_any or bool(k.needs_any & cpu_flags()))
        missing = k.module.load(_env_threads(), expected)
        setattr(st, k.field, k.module.KERNEL.active())
        if missing and expected and not st.problem:
            st.problem = missing
            slower = k.slower
            fix = (f"build it with `make setup` (or `python -m {k.module.__name__}`), or set {k.switch}=off to "
                   "silence this")
    if st.packed_weights and st.attention_kernel and st.vector_math:
        missing = packed_linear.connect(attention_kernel.KERNEL.module, vector_math.KERNEL.module)
        if missing and not st.problem:
            st.problem, slower = missing, "each decoder layer runs as ~20 graph nodes instead of 4, slower"
            fix = "rebuild the kernels with `make setup`, or set REDRAFTER_PACKED_WEIGHTS=off to silence this"
    if st.problem:
        if "small-GEMM" in st.problem:
            slower = "one-token decoding steps run slower"
            fix = ("rebuild it with `make setup` (or `pip install -e .`), or set REDRAFTER_SMALL_GEMM=off to silence "
                   "this")
        elif not slower:
            slower, fix = "one-token decoding steps run slower", ""
        sys.stderr.write(f"warning: {st.problem}: {slower}; {fix}\n")
    _status = st
    return st


def _load_blas(paths: list[str]) -> bool:
    global _loaded, _handle
    for path in paths:
        try:
            _handle = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        _loaded = os.path.basename(path)
        _small_falls_back_to(_handle)
        return True
    return False


def _self_check(st: BlasStatus) -> None:
    """A few-row product (the kernel's) and a larger one (the BLAS's) against numpy; a kernel that gets one wrong
    is switched off."""
    import mlx.core as mx
    import numpy as np

    rng = np.random.default_rng(0)
    w = rng.standard_normal((96, 64), dtype=np.float32)
    for rows in (2, 64):
        x = rng.standard_normal((rows, 64), dtype=np.float32)
        got = np.array(mx.array(x) @ mx.array(w).T)
        ref = x.astype(np.float64) @ w.astype(np.float64).T
        if not np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max():
            if _small is not None:
                _small.redrafter_gemm_enable(ctypes.c_int(0))
                st.small_gemm = False
            st.problem = f"a {rows}-row float32 product through {st.describe()} disagrees with numpy"
            return


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
    for k in KERNELS:
        k.module.KERNEL.set_threads(n)
    for fn in ("MKL_Set_Num_Threads", "openblas_set_num_threads"):
        f = getattr(_handle, fn, None) if _handle is not None else None
        if f is not None:
            f(ctypes.c_int(n))
            return True
    return False


def status() -> BlasStatus:
    """What `install` did in this process (installed=False before it ran)."""
    return _status


def blas_name() -> str:
    """Name of the BLAS MLX uses in this process (for reports), e.g. 'libmkl_rt.so.2+smallgemm2'."""
    return _status.describe()


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


@contextmanager
def small_gemm_avx2() -> Iterator[bool]:
    """Run the kernel's AVX2 + FMA path while inside, even where the CPU has AVX-512 (to test both paths on one
    machine); yields whether the kernel is loaded."""
    if _small is None:
        yield False
        return
    was = _small.redrafter_gemm_use_avx512(ctypes.c_int(0))
    try:
        yield True
    finally:
        _small.redrafter_gemm_use_avx512(ctypes.c_int(was))


def small_gemm_calls() -> tuple[int, int]:
    """(products our small-GEMM path computed, products it handed to the BLAS) so far; (0, 0) without it."""
    if _small is None:
        return 0, 0
    _small.redrafter_gemm_calls.restype = ctypes.c_long
    return _small.redrafter_gemm_calls(1), _small.redrafter_gemm_calls(0)
