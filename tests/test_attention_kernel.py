"""Our CPU attention kernel (x86-64 Linux with AVX-512 or AVX2 + FMA): the same function as MLX's attention, a
query's output independent of the keys it may not see, and decoding through it identical to decoding without it."""

import os

import mlx.core as mx
import numpy as np
import pytest
from kernels import require, without

from mlx_redrafter.model import attention, grouped_mask
from mlx_redrafter.system import attention_kernel
from mlx_redrafter.system.blas import status

# conftest installed the BLAS (and, with the switch on, loaded the kernel) before this module imported mlx.core.
KERNEL = attention_kernel.KERNEL
EXPECTED = KERNEL.expected
ISAS = ["best", "avx2"]


@pytest.fixture
def kernel():
    require(KERNEL)
    return attention_kernel


def reference(scores, v, scale, n, mask):
    """softmax(scores * scale, masked) @ v in float64 (numpy), rows (head in group, token)."""
    s = np.array(scores, dtype=np.float64) * scale
    if mask is not None:
        m = np.array(mask)
        if m.shape[2] != s.shape[2]:
            m = np.tile(m, (1, 1, s.shape[2] // m.shape[2], 1))
        s = np.where(m, s, -np.inf)
    top = s.max(axis=-1, keepdims=True)
    e = np.exp(s - np.where(np.isfinite(top), top, 0))
    total = e.sum(axis=-1, keepdims=True)
    p = np.divide(e, total, out=np.zeros_like(e), where=total > 0)
    return p @ np.array(v, dtype=np.float64)


def test_the_kernel_is_active_where_it_is_expected():
    assert KERNEL.active() or not EXPECTED
    if KERNEL.active():
        assert f"+attn{attention_kernel.VERSION}" in status().describe()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("B,h_kv,G,N,S,D", [(1, 3, 3, 1, 1, 64), (1, 3, 3, 1, 400, 64), (1, 3, 3, 4, 133, 64),
                                            (4, 3, 3, 3, 400, 64), (8, 3, 3, 2, 17, 64), (2, 2, 1, 5, 40, 32),
                                            (3, 1, 4, 2, 75, 80), (2, 4, 2, 9, 300, 128)])
def test_matches_float64(kernel, isa, B, h_kv, G, N, S, D):
    rng = np.random.default_rng(B * 1000 + S)
    scores = mx.array(rng.standard_normal((B, h_kv, G * N, S), dtype=np.float32) * 8)
    v = mx.array(rng.standard_normal((B, h_kv, S, D), dtype=np.float32))
    mask = mx.array(rng.random((B, 1, N, S)) > 0.4)
    with KERNEL.use_isa(isa):
        for m in (None, mask, mx.tile(mask, (1, 1, G, 1)), mask[:1]):
            got = np.array(kernel.softmax_values(scores, v, 0.125, N, m))
            want = reference(scores, v, 0.125, N, m)
            assert np.abs(got - want).max() <= 2e-6 * max(1.0, np.abs(want).max()), (isa, m is None)


@pytest.mark.parametrize("isa", ISAS)
def test_a_query_ignores_the_keys_it_may_not_see_to_the_bit(kernel, isa):
    """The same visible keys give the same bits whether more keys follow (masked) or not: a verified token's
    attention does not depend on the other candidates packed beside it."""
    rng = np.random.default_rng(1)
    B, h_kv, G, N, S, extra = 2, 3, 3, 4, 150, 37
    scores = rng.standard_normal((B, h_kv, G * N, S + extra), dtype=np.float32)
    v = rng.standard_normal((B, h_kv, S + extra, 64), dtype=np.float32)
    mask = rng.random((B, 1, N, S)) > 0.3
    wide = np.concatenate([mask, np.zeros((B, 1, N, extra), bool)], axis=-1)
    with KERNEL.use_isa(isa):
        short = kernel.softmax_values(mx.array(scores[..., :S]), mx.array(v[:, :, :S]), 0.125, N, mx.array(mask))
        long = kernel.softmax_values(mx.array(scores), mx.array(v), 0.125, N, mx.array(wide))
        assert np.array_equal(np.array(short), np.array(long))


def test_a_row_that_sees_no_key_gets_zeros(kernel):
    scores, v = mx.ones((1, 1, 2, 5)), mx.ones((1, 1, 5, 64))
    mask = mx.array(np.array([[[[False] * 5, [True] + [False] * 4]]]))
    out = np.array(kernel.softmax_values(scores, v, 1.0, 2, mask))
    assert np.array_equal(out[0, 0, 0], np.zeros(64)) and np.allclose(out[0, 0, 1], 1.0)


def test_strided_inputs(kernel):
    """Keys and values as the cache hands them (slices of a longer buffer), scores with a transposed last axis."""
    rng = np.random.default_rng(2)
    buf = mx.array(rng.standard_normal((2, 3, 64, 64), dtype=np.float32))
    v = buf[:, :, :41]
    scores_t = mx.array(rng.standard_normal((2, 3, 41, 6), dtype=np.float32)).swapaxes(-1, -2)
    got = np.array(kernel.softmax_values(scores_t, v, 0.5, 2, None))
    assert np.abs(got - reference(scores_t, v, 0.5, 2, None)).max() < 2e-6


def test_bad_arguments_are_refused(kernel):
    with pytest.raises(ValueError, match="float32 scores"):
        kernel.softmax_values(mx.ones((1, 1, 2, 5), dtype=mx.float16), mx.ones((1, 1, 5, 64)), 1.0, 2)
    with pytest.raises(ValueError, match="float32 scores"):
        kernel.softmax_values(mx.ones((1, 1, 3, 5)), mx.ones((1, 1, 5, 64)), 1.0, 2)  # 3 rows, 2 tokens
    with pytest.raises(ValueError, match="mask"):
        kernel.softmax_values(mx.ones((1, 1, 2, 5)), mx.ones((1, 1, 5, 64)), 1.0, 2, mx.ones((1, 1, 2, 4), mx.bool_))


def test_model_attention_agrees_with_mlx_path(kernel):
    """model.attention with and without the kernel, on the shapes a verification step has."""
    rng = np.random.default_rng(3)
    q = mx.array(rng.standard_normal((4, 3, 9, 64), dtype=np.float32)).transpose(0, 2, 1, 3)  # (B, h, N, D) view
    k = mx.array(rng.standard_normal((4, 3, 90, 64), dtype=np.float32))[:, :, :77]
    v = mx.array(rng.standard_normal((4, 3, 90, 64), dtype=np.float32))[:, :, :77]
    mask = mx.array(rng.random((4, 1, 3, 77)) > 0.2)
    got = attention(q, k, v, 0.125, mask)
    with without(KERNEL):
        want = attention(q, k, v, 0.125, grouped_mask(mask, 3, 3))
    assert np.abs(np.array(got) - np.array(want)).max() < 1e-5


def test_threads_share_the_rows_without_changing_a_bit(kernel):
    """A long call (a prefill's) split over two threads by score rows gives the bits of one thread."""
    rng = np.random.default_rng(4)
    scores = mx.array(rng.standard_normal((1, 3, 3 * 70, 300), dtype=np.float32))
    v = mx.array(rng.standard_normal((1, 3, 300, 64), dtype=np.float32))
    mask = mx.array(np.tril(np.ones((70, 300), bool), k=230)[None, None])
    try:
        KERNEL.set_threads(1)
        one = np.array(kernel.softmax_values(scores, v, 0.125, 70, mask))
        KERNEL.set_threads(2)
        two = np.array(kernel.softmax_values(scores, v, 0.125, 70, mask))
    finally:
        KERNEL.set_threads(int(os.environ.get("REDRAFTER_THREADS", os.cpu_count() or 1)))
    assert np.array_equal(one, two)


@pytest.mark.parametrize("B, N", [(1, 1), (1, 3), (4, 3), (64, 1), (2, 17)])
def test_heads_rope_lays_out_q_k_v_with_the_bits_of_the_graph(kernel, B, N):
    """One layer's q, k and v from its fused product, q and k rotated: the bits of the element-wise graph the model
    builds without the kernel (`apply_rope` on the split heads, then transposed), compiled or not, for decoding,
    verification and batched shapes; a strided product is read as it lies."""
    from mlx_redrafter.model import apply_rope, rows_of

    h, h_kv, D = 9, 3, 64

    def graph(y, cos, sin):
        qk, v = mx.split(y, [(h + h_kv) * D], axis=-1)
        q, k = mx.split(apply_rope(rows_of(qk, (B, N), h + h_kv), cos, sin), [h], axis=2)
        return tuple(a.transpose(0, 2, 1, 3) for a in (q, k, rows_of(v, (B, N), h_kv)))

    y = mx.random.normal((B * N, (h + 2 * h_kv) * D), key=mx.random.key(B * 10 + N)) * 3
    theta = mx.random.uniform(shape=(B, N, D // 2), key=mx.random.key(7)) * 300  # far positions too
    cos, sin = mx.cos(theta)[:, :, None, :], mx.sin(theta)[:, :, None, :]
    got = kernel.heads_rope(y, cos, sin, h, h_kv)
    assert [a.shape for a in got] == [(B, h, N, D), (B, h_kv, N, D), (B, h_kv, N, D)]
    for want in (graph(y, cos, sin), mx.compile(graph)(y, cos, sin)):
        assert all(mx.array_equal(a, b).item() for a, b in zip(got, want))
    strided = mx.array(np.ascontiguousarray(np.array(y).T)).T
    assert all(mx.array_equal(a, b).item() for a, b in zip(kernel.heads_rope(strided, cos, sin, h, h_kv), got))
    assert kernel.heads_rope(y.astype(mx.float16), cos, sin, h, h_kv) is None
    with pytest.raises(ValueError):
        kernel.heads_rope(y[:, 1:], cos, sin, h, h_kv)



def test_heads_rope_takes_ragged_rows_with_the_bits_of_the_graph(kernel):
    """Ragged rows (rows verifying different numbers of tokens): the fused product of the T real tokens, each padded
    slot taking the token `Ragged.spread` names, as the graph gathers them."""
    from mlx_redrafter.model import Ragged, apply_rope, rows_of

    h, h_kv, D = 9, 3, 64
    ragged = Ragged([3, 1, 5, 2])
    B, N, T = len(ragged.sizes), ragged.width, ragged.total
    y = mx.random.normal((T, (h + 2 * h_kv) * D), key=mx.random.key(5)) * 3
    theta = mx.random.uniform(shape=(B, N, D // 2), key=mx.random.key(6)) * 300
    cos, sin = mx.cos(theta)[:, :, None, :], mx.sin(theta)[:, :, None, :]
    qk, v = mx.split(y, [(h + h_kv) * D], axis=-1)
    q, k = mx.split(apply_rope(rows_of(qk, (B, N), h + h_kv, ragged.spread), cos, sin), [h], axis=2)
    want = [a.transpose(0, 2, 1, 3) for a in (q, k, rows_of(v, (B, N), h_kv, ragged.spread))]
    got = kernel.heads_rope(y, cos, sin, h, h_kv, ragged.spread)
    assert all(mx.array_equal(a, b).item() for a, b in zip(got, want))
    with pytest.raises(ValueError):
        kernel.heads_rope(y, cos, sin, h, h_kv, ragged.spread[:, :1])
