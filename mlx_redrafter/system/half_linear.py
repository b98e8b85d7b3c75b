"""Our float16-weight product for a drafter on a CPU: an MLX primitive (csrc/half_linear.cpp) that computes
x @ W.T (+ b) for float32 x and a float16 copy of W, reading half the bytes of MLX's float32 product.

A drafter step multiplies a few rows by every weight it has, so it is bound by reading them: in float32 the shipped
drafter is ~35 MB a drafted token, more than this project's CPUs keep in their last-level cache, and MLX's own
float16 and bfloat16 products on a CPU are several times slower than its float32 ones. `draft.half_weights` gives a
float32 drafter float16 copies of the weights that float16 holds exactly (the shipped drafter is stored in float16),
so its drafts are those of the float32 products, read at half the cost. Built against the installed MLX by
`make setup` (`python -m mlx_redrafter.system.half_linear`); where it is not built, does not load or fails its
self-check, drafters run on MLX's float32 products, as before (one line on stderr says so where it was expected).
Switch: REDRAFTER_HALF_WEIGHTS=auto (default) | off.

Importing this module changes nothing; `blas.install()` reads the switch and calls `load()` once MLX is safe to
import.
"""

from __future__ import annotations

import sys

from mlx_redrafter.system.extension import Extension

VERSION = 1  # the kernel build's version (its speed), shown in blas=...+half1
KERNEL = Extension("_half_linear", "half_linear.cpp", "the float16-weight kernel", "MLX's product", VERSION)


def load(threads: int, expected: bool) -> str:
    """Load and check the kernel (once) on a machine it is `expected` to run on (x86-64 Linux with AVX-512, or
    AVX2 + FMA + F16C; elsewhere MLX's float32 product is faster, and is used); returns why it is not active."""
    return KERNEL.load(threads, expected, _self_check)


def usable() -> bool:
    """The kernel is active and MLX computes on the CPU."""
    import mlx.core as mx

    return KERNEL.module is not None and mx.default_device() == mx.cpu


def product(x, weight, bias=None):
    """x (..., K) float32 @ weight (N, K) float16 .T (+ bias (N,)) -> (..., N) float32 (lazy)."""
    assert KERNEL.module is not None
    shape = x.shape
    y = KERNEL.module.half_linear(x.reshape(-1, shape[-1]), weight, bias)
    return y.reshape(*shape[:-1], weight.shape[0])


def _self_check() -> str:
    """Products with a bias, without one, and of a slice of rows, against MLX's float32 product; '' when equal."""
    import mlx.core as mx

    kx, kw, kb = mx.random.split(mx.random.key(0), 3)
    x = mx.random.normal((3, 40), key=kx)
    w = (mx.random.normal((37, 40), key=kw) * 0.1).astype(mx.float16)
    b = mx.random.normal((37,), key=kb)
    w32 = w.astype(mx.float32)
    errs = [mx.abs(product(x, w, b) - (x @ w32.T + b)).max().item(),
            mx.abs(product(x, w[:20]) - x @ w32[:20].T).max().item()]
    return "" if max(errs) <= 1e-5 else f"max difference {max(errs):.2e}"


if __name__ == "__main__":
    sys.exit(0 if KERNEL.build() else 1)
