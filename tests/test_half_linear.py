"""Our float16-weight product for drafters (x86-64 Linux with AVX-512, or AVX2 + FMA + F16C): MLX's float32
product of the same weights, the shipped drafter drafting what its float32 weights draft, and copies that step
aside when they no longer apply (the weights were replaced, the kernel is off)."""

import os

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from kernels import require, without

from mlx_redrafter import api
from mlx_redrafter.draft.beam_search import greedy_steps
from mlx_redrafter.draft.half_weights import linear, use_half_weights
from mlx_redrafter.draft.redrafter import FrequentHead, load_drafter, random_drafter
from mlx_redrafter.shipped import shipped_drafter_path
from mlx_redrafter.system import half_linear
from mlx_redrafter.system.blas import status

# conftest installed the BLAS (and, with the switch on, loaded the kernel) before this module imported mlx.core.
KERNEL = half_linear.KERNEL
EXPECTED = KERNEL.expected


@pytest.fixture
def kernel():
    require(KERNEL)
    return half_linear


@pytest.fixture(scope="module")
def shipped(target):
    """The shipped drafter as decoding loads it (float32, with float16 copies where the kernel is active)."""
    drafter, _ = api.resolve_drafter("default", target)
    yield drafter
    api.resolve_drafter("none", target)


def test_the_kernel_is_active_where_it_is_expected():
    assert KERNEL.active() or not EXPECTED
    if KERNEL.active():
        assert f"+half{half_linear.VERSION}" in status().describe()


@pytest.mark.parametrize("isa", ["best", "avx2", "base"])
@pytest.mark.parametrize("M,N,K", [(1, 1, 1), (1, 8192, 576), (4, 576, 1152), (8, 33, 17), (9, 577, 1000),
                                   (17, 64, 2304), (3, 2, 15)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_the_float32_product(kernel, isa, M, N, K, bias):
    rng = np.random.default_rng(M * 7919 + N * 31 + K)
    x = mx.array(rng.standard_normal((M, K), dtype=np.float32))
    w = mx.array(rng.standard_normal((N, K), dtype=np.float32) * 0.05).astype(mx.float16)
    b = mx.array(rng.standard_normal(N, dtype=np.float32)) if bias else None
    want = np.array(x, dtype=np.float64) @ np.array(w.astype(mx.float32), dtype=np.float64).T
    if bias:
        want += np.array(b, dtype=np.float64)
    with KERNEL.use_isa(isa):
        got = np.array(kernel.product(x, w, b))
    assert got.shape == (M, N) and np.allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(K))


def test_leading_axes_row_slices_and_strided_inputs(kernel):
    rng = np.random.default_rng(3)
    w = mx.array(rng.standard_normal((300, 64), dtype=np.float32) * 0.1).astype(mx.float16)
    w32 = w.astype(mx.float32)
    x = mx.array(rng.standard_normal((2, 3, 64), dtype=np.float32))
    assert np.allclose(np.array(kernel.product(x, w[:100])), np.array(x @ w32[:100].T), atol=1e-5)
    xt = mx.array(rng.standard_normal((64, 5), dtype=np.float32)).T  # columns: a strided x
    assert np.allclose(np.array(kernel.product(xt, w[::2])), np.array(xt @ w32[::2].T), atol=1e-5)


def test_threads_share_the_rows_without_changing_a_bit(kernel):
    rng = np.random.default_rng(4)
    x = mx.array(rng.standard_normal((4, 576), dtype=np.float32))
    w = mx.array(rng.standard_normal((8192, 576), dtype=np.float32) * 0.05).astype(mx.float16)
    try:
        KERNEL.set_threads(1)
        one = np.array(kernel.product(x, w))
        KERNEL.set_threads(2)
        two = np.array(kernel.product(x, w))
    finally:
        KERNEL.set_threads(int(os.environ.get("REDRAFTER_THREADS", os.cpu_count() or 1)))
    assert np.array_equal(one, two)


def test_the_shipped_drafter_drafts_what_its_float32_weights_draft(kernel, shipped, target):
    """Every linear layer of the shipped drafter (stored in float16) has a copy; drafts with and without them are
    the same tokens, from logits equal to float rounding."""
    layers = [m for _, m in shipped.named_modules() if type(m) is nn.Linear]
    assert layers and all(getattr(m, "half", None) is not None and m.half.current() for m in layers)
    head, embed = FrequentHead(shipped, 8192), target.model.embed
    rng = np.random.default_rng(5)
    for B, L in ((1, 5), (4, 4), (8, 3)):
        h = mx.array(rng.standard_normal((B, 576 * (1 + len(shipped.args.feature_layers))), dtype=np.float32))
        g0 = mx.array(rng.integers(0, 49152, B))
        fast = list(greedy_steps(head, embed, h, g0, L))
        with without(KERNEL):
            slow = list(greedy_steps(head, embed, h, g0, L))
        for (t1, l1), (t2, l2) in zip(fast, slow):
            assert mx.array_equal(t1, t2) and mx.abs(l1 - l2).max().item() < 1e-4


def test_a_copy_steps_aside_once_its_layer_holds_another_weight(kernel, shipped):
    layer = shipped.rnn_u
    x = mx.ones((2, 576))
    kept = layer.weight
    try:
        layer.weight = kept * 2  # what an optimizer's update does: a new array
        assert not layer.half.current()
        assert mx.allclose(linear(layer, x), layer(x)).item()
        loss = lambda w: linear(layer, x).sum() + (w * 0).sum()  # noqa: E731
        mx.eval(mx.grad(lambda w: (x @ w.T).sum() + loss(w))(layer.weight))  # differentiable again
    finally:
        layer.weight = kept
    assert layer.half.current()


def test_weights_float16_does_not_hold_get_no_copy(kernel):
    d = random_drafter(576, 49152, seed=9, exit_dim=128, draft_vocab_size=4096)  # float32 random weights
    assert use_half_weights(d) == 0
    exact = load_drafter(shipped_drafter_path("smollm2-135m"))
    exact.rnn_w.weight = exact.rnn_w.weight + 1e-6  # no longer a float16 value
    assert use_half_weights(exact) == len([m for _, m in exact.named_modules() if type(m) is nn.Linear]) - 1
