"""Our CPU attention kernel: an MLX primitive (csrc/attention.cpp) that takes attention's scores (of a decode,
verification or batched step, or a prefill) and returns softmax(scores) @ values in one dispatch.

MLX's CPU backend computes that softmax as 4-5 element-wise and reduction kernels over the whole score tensor; on
this project's CPUs those passes cost about as much as the rest of attention, and more per token as rows x tokens x
keys grow (a batched verification step, a prefill). The kernel is built against the installed MLX by `make setup`
(`python -m mlx_redrafter.system.attention_kernel`), as a Python extension that shares MLX's array type; where it is
not built, does not load, or fails its self-check, attention runs on MLX's own operations, as before (the same
function to float rounding, slower: one line on stderr says so where the kernel was expected).
Switch: REDRAFTER_ATTENTION_KERNEL=auto (default) | off.

Importing this module changes nothing; `blas.install()` reads the switch and calls `load()` once MLX is safe to
import.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

VERSION = 1  # the kernel build's version (its speed), shown in blas=...+attn1
_kernel: ModuleType | None = None
_problem = ""
_tried = False
_isa = ""
_expected = False

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "csrc", "attention.cpp")
STAMP = os.path.join(HERE, "_attention.mlx-version")  # the MLX version the library was built against


def expected() -> bool:
    """Whether `load` was told this machine is one the kernel is built for (x86-64 Linux with AVX-512 or AVX2 +
    FMA; elsewhere it would be slower than MLX's path, and is not used)."""
    return _expected


def load(threads: int, expected: bool) -> str:
    """Load and self-check the kernel (once) on a machine it is `expected` to run on (see `expected`); returns
    why it is not active ('' when it is, or when it is off)."""
    global _kernel, _problem, _tried, _isa, _expected
    if _tried:
        return _problem
    _tried, _expected = True, expected
    if not glob.glob(os.path.join(HERE, "_attention*.so")):
        _problem = "the attention kernel is not built (mlx_redrafter/system/_attention*.so)"
        return _problem
    built, now = built_for(), _mlx_version()
    if built != now:  # MLX's C++ classes may have changed: loading it could crash the process
        _problem = f"the attention kernel was built for MLX {built or 'unknown'}, this is MLX {now}"
        return _problem
    try:
        from mlx_redrafter.system import _attention  # type: ignore[attr-defined]
    except ImportError as e:  # built against another MLX, or no nanobind ABI in common
        _problem = f"the attention kernel does not load ({e})"
        return _problem
    _isa = _attention.set_isa("best")
    if _isa == "base":  # no AVX2: MLX's own path is faster
        return _problem
    _attention.set_threads(max(1, threads))
    _kernel = _attention
    try:
        bad = _self_check()
    except Exception as e:  # e.g. a nanobind that does not share MLX's array type: the call is refused
        bad = f"{type(e).__name__}: {e}"
    if bad:
        _kernel, _problem = None, f"the attention kernel disagrees with MLX's attention ({bad})"
    return _problem


def _mlx_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mlx")
    except PackageNotFoundError:
        return ""


def built_for() -> str:
    """The MLX version the kernel was built against ('' if unknown)."""
    try:
        with open(STAMP) as f:
            return f.read().strip()
    except OSError:
        return ""


def active() -> bool:
    """The kernel is loaded and passed its self-check."""
    return _kernel is not None


def isa() -> str:
    """The instruction set the active kernel runs: 'avx512' or 'avx2' ('' when not active)."""
    return _isa if _kernel is not None else ""


@contextmanager
def use_isa(name: str) -> Iterator[str]:
    """Run the kernel's `name` variant ('avx2', 'avx512', 'base') inside, where this CPU runs it (for tests);
    yields the variant in use."""
    global _isa
    before = _isa
    _isa = _kernel.set_isa(name) if _kernel is not None else ""
    try:
        yield _isa
    finally:
        _isa = _kernel.set_isa(before) if _kernel is not None else before


def set_threads(n: int) -> None:
    """Threads for one kernel call's (batch row, KV head) units (small calls run on one)."""
    if _kernel is not None:
        _kernel.set_threads(max(1, n))


def usable(dtype) -> bool:
    """The kernel takes attention in this dtype on the current device."""
    import mlx.core as mx

    return _kernel is not None and dtype == mx.float32 and mx.default_device() == mx.cpu


def softmax_values(scores, values, scale: float, tokens: int, mask=None):
    """scores (B, h_kv, G * tokens, S) = q.k (unscaled; rows: query head in the group, then token), values
    (B, h_kv, S, D), mask (B|1, 1, tokens | G * tokens, S) bool -> softmax(scores * scale) @ values,
    (B, h_kv, G * tokens, D). A masked key weighs exactly 0."""
    assert _kernel is not None
    return _kernel.softmax_values(scores, values, scale, tokens, mask)


def _self_check() -> str:
    """A masked, grouped call against MLX's own operations; '' when they agree."""
    import mlx.core as mx

    key = mx.random.key(0)
    kq, kk, kv, km = mx.random.split(key, 4)
    B, h_kv, G, N, S, D = 2, 2, 3, 3, 37, 64
    q = mx.random.normal((B, h_kv, G * N, D), key=kq)
    k = mx.random.normal((B, h_kv, S, D), key=kk)
    v = mx.random.normal((B, h_kv, S, D), key=kv)
    mask = mx.random.uniform(shape=(B, 1, N, S), key=km) > 0.3
    mask[..., 0] = True
    scores = q @ k.swapaxes(-1, -2)
    full = mx.tile(mask, (1, 1, G, 1))
    ref = mx.softmax(mx.where(full, scores * 0.125, -mx.inf), axis=-1) @ v
    got = _kernel.softmax_values(scores, v, 0.125, N, mask)
    err = mx.abs(got - ref).max().item()
    return "" if err <= 1e-5 else f"max difference {err:.2e}"


def build(verbose: bool = True) -> bool:
    """Compile csrc/attention.cpp against the installed MLX and nanobind into this package (Linux, g++ with C++20).
    Returns whether it built; a failure leaves no library behind (MLX's path is then used)."""
    import mlx
    import nanobind

    mlx_dir = list(mlx.__path__)[0]
    nb_dir = os.path.dirname(nanobind.__file__)
    out = os.path.join(HERE, "_attention" + sysconfig.get_config_var("EXT_SUFFIX"))
    tmp = out + ".tmp"
    cmd = [os.environ.get("CXX", "g++"), "-O3", "-std=c++20", "-fPIC", "-shared", "-fvisibility=hidden",
           "-fopenmp", "-Wno-psabi", "-DNDEBUG", "-DNB_COMPACT_ASSERTIONS",
           "-DNB_DOMAIN=mlx",  # MLX's Python bindings keep their types in nanobind's "mlx" domain
           "-I" + sysconfig.get_paths()["include"], "-I" + os.path.join(nb_dir, "include"),
           "-I" + os.path.join(nb_dir, "ext", "robin_map", "include"), "-I" + os.path.join(mlx_dir, "include"),
           SOURCE, os.path.join(nb_dir, "src", "nb_combined.cpp"),
           "-L" + os.path.join(mlx_dir, "lib"), "-lmlx", "-Wl,-rpath," + os.path.join(mlx_dir, "lib"), "-o", tmp]
    if verbose:
        print("building the attention kernel (about a minute) ...", file=sys.stderr)
    try:
        res = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        res = subprocess.CompletedProcess(cmd, 1, "", str(e))
    if res.returncode != 0:
        if os.path.exists(tmp):
            os.remove(tmp)
        print("warning: the attention kernel did not build; attention runs on MLX's operations:\n"
              + res.stderr[-2000:], file=sys.stderr)
        return False
    os.replace(tmp, out)
    with open(STAMP, "w") as f:
        f.write(_mlx_version() + "\n")
    return True


if __name__ == "__main__":
    sys.exit(0 if build() else 1)
