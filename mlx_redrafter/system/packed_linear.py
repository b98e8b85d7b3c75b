"""Our packed-weight products on a CPU: an MLX primitive (csrc/packed_linear.cpp) that computes x @ W.T in float32
from W stored packed, in float16 or in MLX's 4- or 8-bit affine quantization, with the bits of the float32 product
of the same weights and a quarter to half of the bytes read.

A decoding step multiplies a few rows by every weight matrix, so on a CPU it costs what reading the weights costs,
and MLX's own float16 and quantized products there are several times slower than its float32 ones: this project
ran float32 copies (538 MB a target call for the embedded 4-bit model). With this kernel a float32 target keeps its
quantized weights beside the float32 copies (`models.packed`), and a drafter float16 copies of the weights float16
holds exactly (`draft.half_weights`); steps of up to `MAX_ROWS` rows read those. The same extension dequantizes a
model's 4- and 8-bit weights at load time (`dequantize`: mx.dequantize's bits, on every thread). Built against the
installed MLX by `make setup` (`python -m mlx_redrafter.system.packed_linear`); where it is not built, does not load
or fails its self-check, the float32 copies serve, as before (one line on stderr says so where it was expected).
Switch: REDRAFTER_PACKED_WEIGHTS=auto (default) | off.

Importing this module changes nothing; `blas.install()` reads the switch and calls `load()` once MLX is safe to
import.
"""

from __future__ import annotations

import sys

from mlx_redrafter.system.extension import Extension

VERSION = 5  # the kernel build's version (its speed), shown in blas=...+packed1
KERNEL = Extension("_packed_linear", "packed_linear.cpp", "the packed-weight kernel", "MLX's product", VERSION)
# Rows up to which a target's product reads its 4- or 8-bit weights packed, by the kernel's variant: past them the
# float32 product is as fast (its arithmetic dominates, and the packed one widens every weight again for each pass
# over the rows). Measured with the embedded model's forwards: AVX-512 on the EPYC (bench/results/cpu-avx512/
# MEASURED.md, 2026-11-28); AVX2 on Zen 3 (bench/results/cpu-avx2/MEASURED.md, 2026-11-28). Either way the result has
# the float32 product's bits: the small-GEMM kernel computes those up to 128 rows (AVX2) or any (AVX-512).
MAX_ROWS = {"avx512": 24, "avx2": 6}
# Rows up to which a model kept quantized (no float32 copy) reads its packed weights; past them its products
# dequantize the weights for that one product into the BLAS. One thread on Zen 3, a forward of the embedded model
# after 200 tokens: kernel / dequantized 82 / 198 ms at 8 rows, 313 / 340 at 32, 556 / 595 at 64, 1182 / 1125 at
# 128 (bench/results/cpu-avx2/quantized-rows-20261129/). AVX-512 takes the AVX2 figure, not measured there.
KEPT_QUANTIZED_MAX_ROWS = {"avx512": 64, "avx2": 64}


def load(threads: int, expected: bool) -> str:
    """Load and check the kernel (once) on a machine it is `expected` to run on (x86-64 Linux with AVX-512, or
    AVX2 + FMA + F16C; elsewhere MLX's float32 product is faster, and is used); returns why it is not active."""
    return KERNEL.load(threads, expected, _self_check)


def usable() -> bool:
    """The kernel is active and MLX computes on the CPU."""
    import mlx.core as mx

    return KERNEL.module is not None and mx.default_device() == mx.cpu


def max_rows(kept_quantized: bool = False) -> int:
    """Rows up to which a target's product reads its packed weights (`kept_quantized`: a model without float32
    weights); 0 where the kernel does not serve targets."""
    return (KEPT_QUANTIZED_MAX_ROWS if kept_quantized else MAX_ROWS).get(KERNEL.isa, 0) if usable() else 0


def _over_rows(x, product, outputs: int):
    """product(x as rows (R, K)) -> (..., outputs): a 2-D x as it is (MLX adds a graph node even for a reshape to
    the same shape, and each node costs a dispatch)."""
    if x.ndim == 2:
        return product(x)
    shape = x.shape
    return product(x.reshape(-1, shape[-1])).reshape(*shape[:-1], outputs)


def half_product(x, weight, bias=None):
    """x (..., K) float32 @ weight (N, K) float16 .T (+ bias (N,)) -> (..., N) float32 (lazy)."""
    return _over_rows(x, lambda rows: KERNEL.module.half_linear(rows, weight, bias), weight.shape[0])


def quantized_product(x, weight, scales, biases, bits: int, group_size: int):
    """x (..., K) float32 @ dequantize(weight, scales, biases).T -> (..., N) float32 (lazy): MLX's affine
    quantization (`mx.quantize`), scales and biases in float32."""
    return _over_rows(x, lambda rows: KERNEL.module.quantized_linear(rows, weight, scales, biases, bits, group_size),
                      weight.shape[0])


def dequantize(weight, scales, biases, bits: int, group_size: int):
    """mx.dequantize(weight, scales, biases) in float32 (scales and biases float32), with its bits, on every
    thread (lazy); MLX's own where the kernel is not active or does not take these weights."""
    import mlx.core as mx

    kernel = KERNEL.module
    if (kernel is None or not hasattr(kernel, "dequantize") or mx.default_device() != mx.cpu or bits not in (4, 8)
            or group_size % 8 != 0 or weight.ndim != 2):
        return mx.dequantize(weight, scales, biases, group_size=group_size, bits=bits)
    return kernel.dequantize(weight, scales, biases, bits, group_size)


def _self_check() -> str:
    """Float16 products with a bias, without one, and of a slice of rows, and 4- and 8-bit products, against
    MLX's float32 products of the same weights; '' when they agree."""
    import mlx.core as mx

    kx, kw, kb = mx.random.split(mx.random.key(0), 3)
    x = mx.random.normal((3, 64), key=kx)
    w32 = mx.random.normal((37, 64), key=kw) * 0.1
    w = w32.astype(mx.float16)
    b = mx.random.normal((37,), key=kb)
    wf = w.astype(mx.float32)
    errs = [mx.abs(half_product(x, w, b) - (x @ wf.T + b)).max().item(),
            mx.abs(half_product(x, w[:20]) - x @ wf[:20].T).max().item()]
    for bits in (4, 8):
        q, s, z = mx.quantize(w32, group_size=32, bits=bits)
        s, z = s.astype(mx.float32), z.astype(mx.float32)
        ref = x @ mx.dequantize(q, s, z, group_size=32, bits=bits).T
        errs.append(mx.abs(quantized_product(x, q, s, z, bits, 32) - ref).max().item())
        if hasattr(KERNEL.module, "dequantize"):
            errs.append(mx.abs(dequantize(q, s, z, bits, 32) - mx.dequantize(q, s, z, group_size=32, bits=bits))
                        .max().item())
    return "" if max(errs) <= 1e-5 else f"max difference {max(errs):.2e}"


if __name__ == "__main__":
    sys.exit(0 if KERNEL.build() else 1)
