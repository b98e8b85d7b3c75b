"""The small-GEMM path (x86-64 with AVX-512 or AVX2 + FMA): right products, the same bits whatever the number
of rows, and the BLAS for everything else."""

import contextlib
import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from mlx_redrafter.system.blas import cpu_flags, small_gemm_avx2, small_gemm_calls, small_gemm_disabled, status

# Where the kernel is built for (x86-64 Linux with AVX-512 or AVX2 + FMA, switch on), its absence is a failure.
# conftest installed the BLAS before this module imported mlx.core, so the status says what install expected.
EXPECTED = sys.platform == "linux" and status().small_gemm_expected
AVX512 = "avx512f" in cpu_flags()


def most_rows(path: str) -> int:
    """The most rows of x a path takes in one product: AVX2 128 (past 8 rows, chunks of 2-3 rows against tiles of 4
    weight rows); AVX-512 any (tested up to 100: three 32-row chunks and a tail, in blocks of 64 weight rows)."""
    return 100 if path == "best" and AVX512 else 128


def have_path() -> bool:
    """Whether products run through the kernel; fails where it is expected and absent, else False."""
    before = small_gemm_calls()
    mx.eval(mx.ones((1, 576)) @ mx.ones((1536, 576)).T)
    active = small_gemm_calls()[0] > before[0]
    if EXPECTED and not active:
        pytest.fail(f"the small-GEMM kernel is not active on a machine it is built for: {status().problem} "
                    f"(make setup rebuilds it)")
    return active


def test_the_kernel_is_active_where_it_is_expected():
    assert have_path() or not EXPECTED


@pytest.mark.parametrize("path", ["best", "avx2"])
def test_products_match_float64(path):
    if not have_path():
        pytest.skip("small-GEMM library not built on this machine (not x86-64 Linux with AVX-512 or AVX2)")
    rng = np.random.default_rng(0)
    shapes = [(1, 1536, 576), (3, 576, 1536), (8, 49152, 576), (16, 960, 576), (5, 200, 512)]
    shapes += [(M, 1007, 576) for M in range(1, 33)]  # every row count, a tail of weight rows (1007 = 4 x 251 + 3)
    shapes += [(M, 1007, 576) for M in (33, 40, 64, 65, 100, 300)]  # AVX-512: chunks of 32 rows, blocks of weights
    with _path(path):
        for M, N, K in shapes:
            x, w = rng.standard_normal((M, K), dtype=np.float32), rng.standard_normal((N, K), dtype=np.float32)
            got = np.array(mx.array(x) @ mx.array(w).T)
            ref = x.astype(np.float64) @ w.astype(np.float64).T
            assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max() + 1e-4, (M, N, K)


@pytest.mark.parametrize("path", ["best", "avx2"])
def test_a_row_gets_the_same_bits_whatever_the_number_of_rows(path):
    if not have_path():
        pytest.skip("small-GEMM library not built on this machine")
    rng = np.random.default_rng(1)
    w = mx.array(rng.standard_normal((1537, 576), dtype=np.float32))
    rows = most_rows(path)
    x = mx.array(rng.standard_normal((rows, 576), dtype=np.float32))
    with _path(path):
        full = np.array(x @ w.T)
        for M in range(1, rows):  # every chunking of the rows (of up to 32 (AVX-512) or 3 (AVX2) rows a chunk)
            assert np.array_equal(np.array(x[:M] @ w.T), full[:M]), M


@pytest.mark.parametrize("path", ["best", "avx2"])
def test_attention_sized_products_match_float64_and_ignore_masked_keys(path):
    """Attention's products (scores = q k^T, weights @ values), per batch row and KV head: tiny, so they run in the
    kernel; a query's result is the same bits whatever the number of queries and however many masked keys
    (weight exactly 0) follow or sit between its visible ones."""
    if not have_path():
        pytest.skip("small-GEMM library not built on this machine")
    rng = np.random.default_rng(2)
    with _path(path):
        for B, M, S, D in [(1, 3, 200, 64), (8, 6, 201, 64), (2, 9, 37, 128), (3, 5, 64, 80), (1, 48, 216, 64)]:
            q = rng.standard_normal((B, M, D), dtype=np.float32)
            k = rng.standard_normal((B, S, D), dtype=np.float32)
            p = rng.random((B, M, S), dtype=np.float32)
            scores, out = np.array(mx.array(q) @ mx.array(k).swapaxes(-1, -2)), np.array(mx.array(p) @ mx.array(k))
            ref_s = q.astype(np.float64) @ k.astype(np.float64).swapaxes(-1, -2)
            ref_o = p.astype(np.float64) @ k.astype(np.float64)
            assert np.abs(scores - ref_s).max() <= 1e-5 * np.abs(ref_s).max(), (B, M, S, D)
            assert np.abs(out - ref_o).max() <= 1e-5 * np.abs(ref_o).max(), (B, M, S, D)
        S, D = 120, 64
        v = mx.array(rng.standard_normal((S + 9, D), dtype=np.float32))
        w = rng.random((9, S + 9), dtype=np.float32)
        w[:, S:] = 0  # keys after the context: not visible yet
        w[4:, 50:60] = 0  # a hole: masked keys between visible ones
        full = np.array(mx.array(w) @ v)
        keep = np.r_[0:50, 60:S]  # what a row with the hole holds alone: its visible keys only
        for m in range(1, 9):
            assert np.array_equal(np.array(mx.array(w[:m, :S]) @ v[:S]), full[:m]), m
            assert np.array_equal(np.array(mx.array(w[m : m + 1]) @ v), full[m : m + 1]), m
            if m >= 4:
                alone = np.array(mx.array(np.ascontiguousarray(w[m : m + 1, keep])) @ v[mx.array(keep)])
                assert np.array_equal(alone, full[m : m + 1]), m
        kq = mx.array(rng.standard_normal((S, D), dtype=np.float32))
        x = mx.array(rng.standard_normal((9, D), dtype=np.float32))
        all_rows = np.array(x @ kq.T)
        for m in range(1, 9):
            assert np.array_equal(np.array(x[:m] @ kq.T), all_rows[:m]), m
            assert np.array_equal(np.array(x[:m] @ kq[:50].T), all_rows[:m, :50]), m


def test_one_row_passed_as_a_column_runs_in_the_kernel():
    """MLX may pass a single row as a transposed column (lda = 1): the same memory, so the kernel takes it."""
    if not have_path():
        pytest.skip("small-GEMM library not built on this machine")
    rng = np.random.default_rng(3)
    w = rng.standard_normal((110, 64), dtype=np.float32)
    x = np.ascontiguousarray(rng.random((9, 110), dtype=np.float32)[4:5, np.r_[0:50, 60:110]])
    fast = small_gemm_calls()[0]
    got = np.array(mx.array(x) @ mx.array(np.ascontiguousarray(w[np.r_[0:50, 60:110]])))
    assert small_gemm_calls()[0] > fast
    ref = x.astype(np.float64) @ w[np.r_[0:50, 60:110]].astype(np.float64)
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()


def _path(path: str):
    """The kernel's best path for this CPU, or its AVX2 + FMA path."""
    return small_gemm_avx2() if path == "avx2" else contextlib.nullcontext()


def test_other_products_go_to_the_blas():
    if not have_path():
        pytest.skip("small-GEMM library not built on this machine")
    fast, slow = small_gemm_calls()
    with small_gemm_avx2():
        mx.eval(mx.ones((129, 576)) @ mx.ones((1536, 576)).T)  # too many rows for the AVX2 path
    mx.eval(mx.ones((4, 576)) @ mx.ones((576, 1536)))  # not x @ W^T, and too large for the tiny path
    with small_gemm_disabled():
        mx.eval(mx.ones((1, 576)) @ mx.ones((1536, 576)).T)
    f2, s2 = small_gemm_calls()
    assert f2 == fast and s2 >= slow + 3


def test_a_decode_step_uses_it(target):
    if not have_path():
        pytest.skip("small-GEMM library not built on this machine")
    from mlx_redrafter.generate import generate_ar

    before = small_gemm_calls()[0]
    ids = target.tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
    list(generate_ar(target.model, ids, max_tokens=3))
    # each one-token step: 4 products per layer (q/k/v and gate/up fused at load, o, down) + the vocabulary
    assert small_gemm_calls()[0] - before >= 2 * (4 * target.model.args.num_hidden_layers + 1)


@pytest.mark.skipif(sys.platform != "linux", reason="the BLAS preload exists only on Linux")
def test_installing_after_mlx_was_imported_warns_in_one_line():
    def stderr(code: str) -> str:
        env = {k: v for k, v in os.environ.items() if k not in ("REDRAFTER_BLAS", "REDRAFTER_SMALL_GEMM")}
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stderr

    late = stderr("import mlx.core, mlx_redrafter; mlx_redrafter.install_blas()").splitlines()
    assert len(late) == 1 and "mlx.core was imported before mlx_redrafter.install_blas()" in late[0], late
    assert stderr("import mlx_redrafter; mlx_redrafter.install_blas(); import mlx.core") == ""
