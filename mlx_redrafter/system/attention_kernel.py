"""Our CPU attention kernel: an MLX primitive (csrc/attention.cpp) that takes attention's scores (of a decode,
verification or batched step, or a prefill) and returns softmax(scores) @ values in one dispatch, and one that
lays out a layer's q, k and v for it from the fused product, rotated (`heads_rope`: one graph node where MLX's
operations took ~13, each a dispatch of its own on the CPU backend; the same bits).

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

import sys

from mlx_redrafter.system.extension import Extension

VERSION = 2  # the kernel build's version (its speed), shown in blas=...+attn2 (2: q, k, v laid out and rotated)
KERNEL = Extension("_attention", "attention.cpp", "the attention kernel", "MLX's attention", VERSION)


def load(threads: int, expected: bool) -> str:
    """Load and check the kernel (once) on a machine it is `expected` to run on (x86-64 Linux with AVX-512 or
    AVX2 + FMA; elsewhere it would be slower than MLX's path, and is not used); returns why it is not active."""
    return KERNEL.load(threads, expected, _self_check)


def usable(dtype) -> bool:
    """The kernel takes attention in this dtype on the current device."""
    import mlx.core as mx

    return KERNEL.module is not None and dtype == mx.float32 and mx.default_device() == mx.cpu


def softmax_values(scores, values, scale: float, tokens: int, mask=None):
    """scores (B, h_kv, G * tokens, S) = q.k (unscaled; rows: query head in the group, then token), values
    (B, h_kv, S, D), mask (B|1, 1, tokens | G * tokens, S) bool -> softmax(scores * scale) @ values,
    (B, h_kv, G * tokens, D). A masked key weighs exactly 0."""
    assert KERNEL.module is not None
    return KERNEL.module.softmax_values(scores, values, scale, tokens, mask)


def heads_rope(qkv, cos, sin, heads: int, kv_heads: int, spread=None):
    """A layer's (q, k, v) from its fused product qkv (B * N, (heads + 2 kv_heads) * D), laid out for attention:
    q (B, heads, N, D), k and v (B, kv_heads, N, D), q and k rotated by the per-token angles cos, sin
    (B, N, 1, D / 2) (half-split rope), in one node; the bits of the element-wise graph (`model.apply_rope`).
    Ragged rows: qkv holds the T real tokens and `spread` (B, N) the token each slot takes (`model.Ragged`, every
    index below T). None where the kernel does not take them (another dtype or device, or a kernel built before
    this function)."""
    if not usable(qkv.dtype) or cos.dtype != qkv.dtype or sin.dtype != qkv.dtype:
        return None
    if not hasattr(KERNEL.module, "heads_rope"):
        return None
    return tuple(KERNEL.module.heads_rope(qkv, cos, sin, heads, kv_heads, spread))


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
    got = softmax_values(scores, v, 0.125, N, mask)
    err = mx.abs(got - ref).max().item()
    return "" if err <= 1e-5 else f"max difference {err:.2e}"


if __name__ == "__main__":
    sys.exit(0 if KERNEL.build() else 1)
