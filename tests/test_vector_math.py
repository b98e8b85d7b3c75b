"""Our vector-math kernels (x86-64 Linux with AVX-512 or AVX2 + FMA): log-sum-exp and SiLU and their gradients,
and the MLP gate, against float64, top k against a stable sort, the special values MLX gives, inside `mx.compile`
and a training step, the training losses the same with and without them, and the shipped drafter drafting the
same."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from kernels import require, without

from mlx_redrafter.system import vector_math
from mlx_redrafter.system.blas import status
from mlx_redrafter.system.vector_math import log_probs_at
from mlx_redrafter.train.loss import cross_entropy

KERNEL = vector_math.KERNEL
ISAS = ["best", "avx2"]


@pytest.fixture
def kernel():
    require(KERNEL)
    return vector_math


def reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """logsumexp over the last axis and its gradient (softmax) in float64."""
    x = x.astype(np.float64)
    top = x.max(axis=-1, keepdims=True)
    lse = top + np.log(np.exp(x - top).sum(axis=-1, keepdims=True))
    return lse[..., 0], np.exp(x - lse)


def test_the_kernel_is_active_where_it_is_expected():
    assert KERNEL.active() or not KERNEL.expected
    if KERNEL.active():
        assert f"+vmath{vector_math.VERSION}" in status().describe()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (2, 16), (5, 17), (4, 3, 8192), (2, 49152), (300, 300)])
def test_logsumexp_and_its_gradient_match_float64(kernel, isa, shape):
    rng = np.random.default_rng(sum(shape))
    x = rng.standard_normal(shape).astype(np.float32) * 6
    g = rng.standard_normal(shape[:-1]).astype(np.float32)
    want, soft = reference(x)
    with KERNEL.use_isa(isa):
        (got,), (grad,) = mx.vjp(kernel.logsumexp, [mx.array(x)], [mx.array(g)])
    assert got.shape == shape[:-1]
    assert np.abs(np.array(got) - want).max() <= 1e-5 * max(1.0, np.abs(want).max())
    assert np.abs(np.array(grad) - soft * g[..., None]).max() <= 1e-5


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape", [(1,), (7,), (3, 16), (5, 17), (1024, 5, 576)])
def test_silu_and_its_gradient_match_float64(kernel, isa, shape, monkeypatch):
    monkeypatch.setattr(kernel, "SILU_MIN", 0)  # the kernel at every size
    rng = np.random.default_rng(sum(shape))
    x = rng.standard_normal(shape).astype(np.float32) * 8
    x.flat[0] = 95.0  # far out on both sides: no overflow
    x.flat[-1] = -95.0
    g = rng.standard_normal(shape).astype(np.float32)
    s = 1 / (1 + np.exp(-x.astype(np.float64)))
    with KERNEL.use_isa(isa):
        (got,), (grad,) = mx.vjp(kernel.silu, [mx.array(x)], [mx.array(g)])
    assert np.abs(np.array(got) - x * s).max() <= 2e-6 * max(1.0, np.abs(x).max())
    assert np.abs(np.array(grad) - g * s * (1 + x * (1 - s))).max() <= 1e-5


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape", [(1, 1536), (3, 5), (8, 1536), (64, 1536)])
def test_the_mlp_gate_matches_float64(kernel, isa, shape):
    rng = np.random.default_rng(sum(shape))
    g, u = (rng.standard_normal(shape).astype(np.float32) * 4 for _ in range(2))
    want = g * u / (1 + np.exp(-g.astype(np.float64)))
    with KERNEL.use_isa(isa):
        got = np.array(kernel.silu_mul(mx.array(g), mx.array(u)))
    assert np.abs(got - want).max() <= 2e-6 * np.abs(want).max()
    assert kernel.silu_mul(mx.array(g).astype(mx.float16), mx.array(u).astype(mx.float16)) is None


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape", [(1, 3072), (3, 3072), (64, 3072), (2, 3, 3072), (4, 32)])
def test_the_mlp_gate_reads_the_fused_product_in_place(kernel, isa, shape):
    """silu(gate) * up from the gate and up halves side by side: the bits of the kernel on the halves split apart
    (the last axis' halves are whole vectors of every variant here: 16 floats for AVX-512; a shorter row's tail
    takes the scalar path, which the split halves' flat pass may run vectorized), for a product's output and for a
    transposed view."""
    rng = np.random.default_rng(sum(shape))
    gu = mx.array(rng.standard_normal(shape).astype(np.float32) * 4)
    with KERNEL.use_isa(isa):
        for x in (gu, mx.array(np.ascontiguousarray(np.array(gu).T)).T):
            got = kernel.silu_mul_halves(x)
            assert got.shape == (*shape[:-1], shape[-1] // 2)
            assert mx.array_equal(got, kernel.silu_mul(*mx.split(x, 2, axis=-1))).item()
    assert kernel.silu_mul_halves(gu.astype(mx.float16)) is None
    assert kernel.silu_mul_halves(gu[..., 1:]) is None  # an odd last axis has no halves


@pytest.mark.parametrize("shape", [(1, 576), (3, 576), (64, 576), (2, 5, 4096), (4, 37)])
def test_rms_norm_has_the_bits_of_the_compiled_graph(kernel, shape):
    """One node for x over its RMS (times a weight or not): the bits of MLX's graph for it, compiled, for a
    row-major input and a transposed view; other dtypes are not taken."""
    from mlx_redrafter.model import _over_rms_compiled, _rms_norm_compiled

    rng = np.random.default_rng(sum(shape))
    x = mx.array(rng.standard_normal(shape).astype(np.float32) * 3)
    w = mx.array(rng.standard_normal(shape[-1]).astype(np.float32))
    inv = 1.0 / shape[-1]
    for xs in (x, mx.array(np.ascontiguousarray(np.array(x).T)).T):
        assert mx.array_equal(kernel.rms_norm(xs, w, 1e-5), _rms_norm_compiled(x, w, 1e-5, inv)).item()
        assert mx.array_equal(kernel.rms_norm(xs, None, 1e-6), _over_rms_compiled(x, 1e-6, inv)).item()
    assert kernel.rms_norm(x.astype(mx.float16), None, 1e-5) is None


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape, k", [((1, 1), 1), ((3, 8), 8), ((5, 37), 8), ((2, 33), 5), ((4, 100), 64),
                                      ((300, 49152), 8)])
def test_top_k_is_a_stable_sort_s_first_k(kernel, isa, shape, k):
    rng = np.random.default_rng(sum(shape) + k)
    x = rng.standard_normal(shape).astype(np.float32)
    x[0, -1] = x[0, 0] = x[0].max() + 1  # equal values at the top: index order
    if shape[1] > 2:
        x[-1, 1] = x[-1, 2] = np.sort(x[-1])[-min(k, shape[1] - 2)]  # and at the k-th
    with KERNEL.use_isa(isa):
        got = np.array(kernel.top_k(mx.array(x), k))
    assert got.dtype == np.int32 and got.shape == (shape[0], k)
    assert np.array_equal(got, np.argsort(-x, axis=-1, kind="stable")[:, :k])


def test_special_values_are_those_of_mlx(kernel, monkeypatch):
    monkeypatch.setattr(kernel, "SILU_MIN", 0)
    inf, nan = float("inf"), float("nan")
    x = mx.array([[0.0, -inf, 1.0], [-inf, -inf, -inf], [inf, 0.0, 1.0], [nan, 0.0, 1.0], [-inf, 2.0, -inf]])
    got, want = np.array(kernel.logsumexp(x)), np.array(mx.logsumexp(x, axis=-1))
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert np.allclose(got[~np.isnan(got)], want[~np.isnan(want)], atol=1e-6)
    grad = np.array(mx.grad(lambda a: kernel.logsumexp(a).sum())(x[:2]))
    assert np.allclose(grad, [[1 / (1 + np.e), 0, np.e / (1 + np.e)], [0, 0, 0]], atol=1e-6)
    assert grad[0, 1] == 0.0  # a logit of -inf has weight exactly 0
    y = mx.array([0.0, inf, -inf, nan])
    got, want = np.array(kernel.silu(y)), np.array(nn.silu(y))
    assert np.array_equal(got, want, equal_nan=True)  # silu(-inf) is NaN in both (-inf * 0)


def test_other_dtypes_run_mlx_s_own(kernel):
    x = mx.random.normal((3, 40), key=mx.random.key(2)).astype(mx.float16)
    assert not kernel.usable(x)
    assert kernel.logsumexp(x).dtype == mx.float16


def test_training_losses_are_the_same_with_and_without_it_compiled_or_not(kernel):
    rng = np.random.default_rng(5)
    logits = mx.array(rng.standard_normal((6, 5, 300)).astype(np.float32) * 3)
    index = mx.array(rng.integers(0, 300, (6, 5, 4)).astype(np.int32))
    prob = mx.softmax(mx.array(rng.standard_normal((6, 5, 4)).astype(np.float32)), axis=-1)

    def loss(x):
        return -(prob * log_probs_at(x, index)).sum() + cross_entropy(x, index[..., 0]).sum()

    def mlx_loss(x):
        logp = nn.log_softmax(x, axis=-1)
        return (-(prob * mx.take_along_axis(logp, index, axis=-1)).sum()
                + nn.losses.cross_entropy(x, index[..., 0], reduction="sum"))

    want, want_grad = mx.value_and_grad(mlx_loss)(logits)
    for fn in (mx.value_and_grad(loss), mx.compile(mx.value_and_grad(loss))):
        got, grad = fn(logits)
        assert abs(got.item() - want.item()) <= 1e-5 * abs(want.item())
        assert mx.abs(grad - want_grad).max().item() <= 1e-5
    with without(KERNEL):
        got, grad = mx.value_and_grad(loss)(logits)
    assert abs(got.item() - want.item()) <= 1e-5 * abs(want.item())



def test_the_shipped_drafter_drafts_the_same_with_and_without_them(kernel, target, monkeypatch):
    """The recurrent drafter's SiLUs through the kernel (as in training; drafting's few rows keep MLX's): the same
    greedy drafts and beams, logits equal to float rounding."""
    monkeypatch.setattr(kernel, "SILU_MIN", 0)
    from mlx_redrafter import api
    from mlx_redrafter.draft.beam_search import beam_search, greedy_steps
    from mlx_redrafter.draft.redrafter import FrequentHead

    drafter, _ = api.resolve_drafter("default", target)
    try:
        head, embed = FrequentHead(drafter, 8192), target.model.embed
        rng = np.random.default_rng(9)
        for B, W, L in ((1, 1, 5), (3, 4, 4), (8, 1, 3)):
            h = mx.array(rng.standard_normal((B, 576 * (1 + len(drafter.args.feature_layers))), dtype=np.float32))
            g0 = mx.array(rng.integers(0, 49152, B))
            fast = beam_search(head, embed, h, g0, W, L), list(greedy_steps(head, embed, h, g0, L))
            with without(KERNEL):
                slow = beam_search(head, embed, h, g0, W, L), list(greedy_steps(head, embed, h, g0, L))
            assert mx.array_equal(fast[0][0], slow[0][0]) and mx.abs(fast[0][1] - slow[0][1]).max().item() < 1e-4
            for (t1, l1), (t2, l2) in zip(fast[1], slow[1]):
                assert mx.array_equal(t1, t2) and mx.abs(l1 - l2).max().item() < 1e-4
    finally:
        api.resolve_drafter("none", target)
