"""Our CPU vector-math kernels: MLX primitives (csrc/vector_math.cpp) for log(sum(exp(x))) over the last axis and
for SiLU, each with its gradient, and the top k of a row.

MLX's CPU wheel computes `exp`, `sigmoid` and `tanh` one element at a time, ~10-14 ns an element here (an
addition takes 0.2 ns). Where there are many of them that dominates: a drafter's training step normalises the
head's 8,192 logits at 1,024 positions x 5 draft steps (42M exps) and takes the SiLU of its ResBlocks and its
recurrent update (18M), and the teacher-forced feature pass normalises the target's 49,152 logits a token and
picks their top 8 (MLX's `argpartition` there took ~0.3 ms a token, as long as the vocabulary product). The
kernels take them in vector registers (2^x by a polynomial), 10-60x faster, and closer to float64 than MLX's (the
log-sum-exp of 8,192 logits and its gradient within ~3e-6 of it, MLX's ~3e-5). The target's MLP gate takes the
SiLU too (`model.silu_mul`, silu(g) * u in one pass: MLX's compiled power-of-two form costs ~7 ns an element, 0.7 ms
a layer at 64 rows): prefills 5-15% faster, the feature pass ~5%, batched greedy steps of 64 rows a few percent,
decoding steps the same; `silu_mul_halves` reads the gate and up halves of the fused product in place. The target's
RMS norms (`rms_norm`) take one node where MLX's graph takes three, with its bits: on MLX's CPU backend every node
is a dispatch of its own, a few microseconds each (bench/results/cpu-avx2/graph-nodes-20261130/). A drafting
step's SiLUs are too few to gain (`SILU_MIN`); its log-probabilities stay MLX's.
Built against the installed MLX by `make setup` (`python -m mlx_redrafter.system.vector_math`); where they are not
built, do not load, or fail their self-check, MLX's own operations run (the same functions to float rounding,
slower: one line on stderr says so where the kernels were expected).
Switch: REDRAFTER_VECTOR_MATH=auto (default) | off.

Importing this module changes nothing; `blas.install()` reads the switch and calls `load()` once MLX is safe to
import.
"""

from __future__ import annotations

import sys

from mlx_redrafter.system.extension import Extension

VERSION = 2  # the kernels' build version (their speed), shown in blas=...+vmath2 (2: norms, the MLP gate in place)
KERNEL = Extension("_vector_math", "vector_math.cpp", "the vector-math kernels", "MLX's operations", VERSION)
_custom: dict = {}  # name -> custom function (built on first use: they need mlx.core)


def load(threads: int, expected: bool) -> str:
    """Load and check the kernel (once) on a machine it is `expected` to run on (x86-64 Linux with AVX-512 or
    AVX2 + FMA); returns why it is not active."""
    return KERNEL.load(threads, expected, _self_check)


def usable(x) -> bool:
    """The kernels take this array (float32, on the CPU)."""
    import mlx.core as mx

    return KERNEL.module is not None and x.dtype == mx.float32 and x.size > 0 and mx.default_device() == mx.cpu


def logsumexp(x):
    """log(sum(exp(x), axis=-1)) (shape x.shape[:-1]), differentiable: the kernel where `usable`, else MLX's."""
    import mlx.core as mx

    if not usable(x):
        return mx.logsumexp(x, axis=-1)
    return _function("logsumexp")(x.reshape(-1, x.shape[-1])).reshape(x.shape[:-1])


def log_probs_at(logits, index):
    """log softmax(logits) along the last axis at `index` (..., k) only, differentiable (the full log-softmax is
    never formed)."""
    import mlx.core as mx

    return mx.take_along_axis(logits, index, axis=-1) - logsumexp(logits)[..., None]


SILU_MIN = 1 << 16  # elements below which `silu` keeps MLX's (one compiled node; ours adds the custom function's)


def silu(x):
    """x * sigmoid(x), differentiable: the kernel where `usable` and x has at least `SILU_MIN` elements (training
    batches; a drafting step's few rows are faster through MLX's), else MLX's `nn.silu`."""
    if not usable(x) or x.size < SILU_MIN:
        import mlx.nn as nn

        return nn.silu(x)
    return _function("silu")(x)


def silu_mul(g, u):
    """silu(g) * u in one pass (a Llama MLP's gate; not differentiable: the target is not trained here) where
    `usable`; None elsewhere (the caller keeps its own)."""
    if not usable(g) or u.dtype != g.dtype or u.shape != g.shape:
        return None
    return KERNEL.module.silu_mul(g, u)


def silu_mul_halves(gu):
    """silu(gate) * up for gu (..., 2h) holding the gate and up halves side by side, in one pass where `usable`;
    None elsewhere (and where the built kernel predates it)."""
    if not usable(gu) or gu.shape[-1] % 2 or not hasattr(KERNEL.module, "silu_mul_halves"):
        return None
    return KERNEL.module.silu_mul_halves(gu)


def rms_norm(x, weight, eps: float):
    """x (..., n) over its RMS along the last axis, times weight (n) where given, in one node where `usable`: the
    bits of MLX's own graph for it (`model.rms_norm`); None elsewhere (and where the built kernel predates it)."""
    import mlx.core as mx

    if not usable(x) or (weight is not None and weight.dtype != mx.float32):
        return None
    if not hasattr(KERNEL.module, "rms_norm"):
        return None
    return KERNEL.module.rms_norm(x, weight, eps)


def top_k(x, k: int):
    """The indices (..., k) int32 of the k largest values along the last axis, largest first (the kernel gives
    equal values in index order, as a stable sort would), not differentiable: the kernel where `usable` and
    k <= 64, else MLX's `argpartition` and `argsort`."""
    import mlx.core as mx

    if usable(x) and 1 <= k <= min(64, x.shape[-1]):
        return KERNEL.module.top_k_rows(x.reshape(-1, x.shape[-1]), k).reshape(*x.shape[:-1], k)
    top = mx.argpartition(-x, k - 1, axis=-1)[..., :k]
    order = mx.argsort(-mx.take_along_axis(x, top, axis=-1), axis=-1)  # argpartition leaves the k unordered
    return mx.take_along_axis(top, order, axis=-1).astype(mx.int32)


def _function(name: str):
    """The kernel `name` as a custom MLX function with its gradient (one input: MLX passes it, and takes its
    gradient, bare)."""
    if name not in _custom:
        import mlx.core as mx

        k = KERNEL.module
        if name == "logsumexp":
            fn = mx.custom_function(lambda x: k.logsumexp_rows(x))
            fn.vjp(lambda x, cotangent, output: k.softmax_scaled_rows(x, output, cotangent))
        else:
            fn = mx.custom_function(lambda x: k.silu(x))
            fn.vjp(lambda x, cotangent, output: k.silu_grad(x, cotangent))
        _custom[name] = fn
    return _custom[name]


def _self_check() -> str:
    """Each kernel on a few rows (values and gradients) against MLX's own operations; '' when they agree."""
    import mlx.core as mx
    import mlx.nn as nn

    x = mx.random.normal((5, 37), key=mx.random.key(0)) * 6
    g = mx.random.normal((5,), key=mx.random.key(1))
    gx = mx.random.normal((5, 37), key=mx.random.key(2))
    err = 0.0
    for fast, ref, cot in ((logsumexp, lambda a: mx.logsumexp(a, axis=-1), g), (_function("silu"), nn.silu, gx)):
        got, got_grad = mx.vjp(fast, [x], [cot])
        want, want_grad = mx.vjp(ref, [x], [cot])
        err = max(err, mx.abs(got[0] - want[0]).max().item(), mx.abs(got_grad[0] - want_grad[0]).max().item())
    err = max(err, mx.abs(silu_mul(x, gx) - nn.silu(x) * gx).max().item())
    if not mx.array_equal(top_k(x, 5), mx.argsort(-x, axis=-1)[:, :5]).item():
        return "top_k differs from a sort"
    return "" if err <= 1e-5 else f"max difference {err:.2e}"


if __name__ == "__main__":
    sys.exit(0 if KERNEL.build() else 1)
