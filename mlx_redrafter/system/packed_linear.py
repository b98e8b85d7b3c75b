"""Our packed-weight products on a CPU: an MLX primitive (csrc/packed_linear.cpp) that computes x @ W.T in float32
from W stored packed, in float16 or in MLX's 4- or 8-bit affine quantization, with the bits of the float32 product
of the same weights and a quarter to half of the bytes read.

A decoding step multiplies a few rows by every weight matrix, so on a CPU it costs what reading the weights costs,
and MLX's own float16 and quantized products there are several times slower than its float32 ones: this project
ran float32 copies (538 MB a target call for the embedded 4-bit model). With this kernel a float32 target keeps its
quantized weights beside the float32 copies (`models.packed`), and a drafter 8-bit (or float16) copies of its
weights (`draft.weight_copies`); steps of up to `MAX_ROWS` rows read those. The same extension dequantizes a
model's 4- and 8-bit weights at load time (`dequantize`: mx.dequantize's bits, on every thread), and runs a decoder
layer of such a step as two nodes around the cache write (`layer_before`, `layer_after`: the same bits as the ~21
separate nodes, with the attention and vector-math kernels' code, `connect`). Built against the
installed MLX by `make setup` (`python -m mlx_redrafter.system.packed_linear`); where it is not built, does not load
or fails its self-check, the float32 copies serve, as before (one line on stderr says so where it was expected).
Switch: REDRAFTER_PACKED_WEIGHTS=auto (default) | off.

Importing this module changes nothing; `blas.install()` reads the switch and calls `load()` once MLX is safe to
import.
"""

from __future__ import annotations

import sys

from mlx_redrafter.system import attention_kernel, vector_math
from mlx_redrafter.system.extension import Extension

VERSION = 7  # the kernel build's version (its speed), shown in blas=...+packed7 (6: a layer as two nodes; 7: AVX-512
# blocks of 4 weight rows at 2-3 rows of x)
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


def quantized_product(x, weight, scales, biases, bits: int, group_size: int, bias=None):
    """x (..., K) float32 @ dequantize(weight, scales, biases).T (+ bias (N,)) -> (..., N) float32 (lazy): MLX's
    affine quantization (`mx.quantize`), scales and biases in float32."""
    return _over_rows(x, lambda rows: KERNEL.module.quantized_linear(rows, weight, scales, biases, bits, group_size,
                                                                     bias), weight.shape[0])


def dequantize(weight, scales, biases, bits: int, group_size: int):
    """mx.dequantize(weight, scales, biases) in float32 (scales and biases float32), with its bits, on every
    thread (lazy); MLX's own where the kernel is not active or does not take these weights."""
    import mlx.core as mx

    kernel = KERNEL.module
    if (kernel is None or not hasattr(kernel, "dequantize") or mx.default_device() != mx.cpu or bits not in (4, 8)
            or group_size % 8 != 0 or weight.ndim != 2):
        return mx.dequantize(weight, scales, biases, group_size=group_size, bits=bits)
    return kernel.dequantize(weight, scales, biases, bits, group_size)


def connect(attention_ext, vector_math_ext) -> str:
    """Hand the kernel the attention and vector-math kernels' tables (the loaded extensions `attention_ext` and
    `vector_math_ext`), which `layer_before` and `layer_after` run beside its products, and check those against the
    separate nodes; returns why they are not available ('' when they are)."""
    global _connected
    kernel = KERNEL.module
    _connected = False
    if kernel is None or not hasattr(kernel, "layer_before"):
        return "the packed-weight kernel is not built with layer_before and layer_after"
    if attention_ext is None or vector_math_ext is None or not (hasattr(attention_ext, "kernels")
                                                               and hasattr(vector_math_ext, "kernels")):
        return "the attention or vector-math kernels are not active (or were built before they handed kernels over)"
    if not kernel.set_kernels(attention_ext.kernels(), vector_math_ext.kernels()):
        return "the attention kernel was built before it handed heads_rope over, or no cblas_sgemm to call"
    bad = _fused_layers_check(attention_ext, vector_math_ext)
    _connected = not bad
    return f"the fused layer nodes disagree with the separate nodes ({bad})" if bad else ""


_connected = False  # connect() handed the kernel the other kernels and the fused nodes passed their check


def fused_layers_ready() -> bool:
    """`layer_before` and `layer_after` can run: the kernel and the two it runs beside are active, connected
    (`connect`), and MLX computes on the CPU."""
    return (_connected and usable() and attention_kernel.KERNEL.module is not None
            and vector_math.KERNEL.module is not None)


def layer_before(x, norm, qkv, cos, sin, heads: int, kv_heads: int, bits: int, group_size: int, eps: float):
    """A decoder layer's work before the cache write (`CompiledLayer`'s `before`) in one node: x (B * N, H), the
    input norm's weight, the q/k/v product's quantized weights as (weight, scales, biases), the rope's cos and sin
    (B, N, 1, D / 2) -> (q (B, heads, N, D), k, v (B, kv_heads, N, D)) as `attention_kernel.heads_rope` lays them
    out (lazy). The bits of the separate nodes."""
    return tuple(KERNEL.module.layer_before(x, norm, *qkv, cos, sin, heads, kv_heads, bits, group_size, eps))


def layer_after(x, q, keys, values, visible: int, mask, o, norm, gate_up, down, bits: int, group_size: int,
                scale: float, eps: float):
    """A decoder layer's work after the cache write (the attention and `CompiledLayer`'s `after`) in one node: x
    (T, H), q (B, h, N, D) as `layer_before` lays it out, the cache's keys and values (B, h_kv, C, D) already
    holding this step's entries (the first `visible` attended), mask (B|1, 1, N, visible) bool or None, the
    output, gate/up and down products' quantized weights as (weight, scales, biases) and the MLP norm's weight ->
    the layer's output (T, H) (lazy). The bits of the separate nodes."""
    return KERNEL.module.layer_after(x, q, keys, values, visible, mask, *o, norm, *gate_up, *down, bits, group_size,
                                     scale, eps)


def _fused_layers_check(attention_ext, vector_math_ext) -> str:
    """`layer_before` and `layer_after` of one token and of three (with a mask), against the separate nodes they
    stand for; '' when they agree bit for bit."""
    import mlx.core as mx

    keys = iter(mx.random.split(mx.random.key(1), 20))
    H, inner, h, hkv, D, S = 64, 96, 4, 2, 16, 11

    def weights(n, k):
        q, s, b = mx.quantize(mx.random.normal((n, k), key=next(keys)) * 0.1, group_size=32, bits=4)
        return q, s.astype(mx.float32), b.astype(mx.float32)

    qkv, o, gate_up, down = weights((h + 2 * hkv) * D, H), weights(H, h * D), weights(2 * inner, H), weights(H, inner)
    norm1, norm2 = (1 + 0.1 * mx.random.normal((H,), key=next(keys)) for _ in range(2))
    cache_k, cache_v = (mx.random.normal((1, hkv, S + 5, D), key=next(keys)) for _ in range(2))
    for n, masked in ((1, False), (3, True)):
        x = mx.random.normal((n, H), key=next(keys))
        angles = mx.random.uniform(shape=(1, n, 1, D // 2), key=next(keys)) * 6
        cos, sin = mx.cos(angles), mx.sin(angles)
        got = layer_before(x, norm1, qkv, cos, sin, h, hkv, 4, 32, 1e-5)
        normed = vector_math_ext.rms_norm(x, norm1, 1e-5)
        ref = attention_ext.heads_rope(quantized_product(normed, *qkv, 4, 32), cos, sin, h, hkv)
        if not all(mx.array_equal(a, b).item() for a, b in zip(got, ref)):
            return f"layer_before, {n} token(s)"
        q = got[0]
        mask = (mx.random.uniform(shape=(1, 1, n, S), key=next(keys)) > 0.3) | (mx.arange(S) == 0) if masked else None
        got = layer_after(x, q, cache_k, cache_v, S, mask, o, norm2, gate_up, down, 4, 32, 0.25, 1e-5)
        scores = q.reshape(1, hkv, h // hkv * n, D) @ cache_k[:, :, :S].swapaxes(-1, -2)
        out = attention_ext.softmax_values(scores, cache_v[:, :, :S], 0.25, n, mask).reshape(1, h, n, D)
        rows = out.reshape(1, h * D) if n == 1 else out.transpose(0, 2, 1, 3).reshape(n, h * D)
        h1 = x + quantized_product(rows, *o, 4, 32)
        normed = vector_math_ext.rms_norm(h1, norm2, 1e-5)
        gated = vector_math_ext.silu_mul_halves(quantized_product(normed, *gate_up, 4, 32))
        ref = h1 + quantized_product(gated, *down, 4, 32)
        if not mx.array_equal(got, ref).item():
            return f"layer_after, {n} token(s): max difference {mx.abs(got - ref).max().item():.2e}"
    return ""


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
