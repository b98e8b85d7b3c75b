"""The A/B library's products y = x w^T (x: M x K, w: N x K, float32, one thread) through its cblas_sgemm, committed
3 x 4 tiles against 4 x 3 tiles: the same bits for every M (checked), then the time of each, alternated in one
process (R rounds, the order flipping every round). Usage: python rows_ab.py LIB R"""
import ctypes
import sys
import time

import numpy as np

lib = ctypes.CDLL(sys.argv[1])
R = int(sys.argv[2])
P = ctypes.POINTER(ctypes.c_float)
lib.cblas_sgemm.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, P, ctypes.c_int, P, ctypes.c_int, ctypes.c_float,
                                                 P, ctypes.c_int]


def gemm(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    M, K = x.shape
    N = w.shape[0]
    y = np.empty((M, N), np.float32)
    lib.cblas_sgemm(101, 111, 112, M, N, K, 1.0, x.ctypes.data_as(P), K, w.ctypes.data_as(P), K, 0.0,
                    y.ctypes.data_as(P), N)
    return y


rng = np.random.default_rng(0)
shapes = {"qkv": (960, 576), "o": (576, 576), "up/gate": (3072, 576), "down": (576, 1536), "vocab": (49152, 576)}
weights = {k: rng.standard_normal(s, dtype=np.float32) for k, s in shapes.items()}
for M in list(range(9, 129)):
    x = rng.standard_normal((M, 1536), dtype=np.float32)
    for name, w in weights.items():
        xs = np.ascontiguousarray(x[:, : w.shape[1]])
        lib.redrafter_ab_43(0)
        a = gemm(xs, w)
        lib.redrafter_ab_43(1)
        b = gemm(xs, w)
        assert np.array_equal(a.view(np.int32), b.view(np.int32)), (M, name)
        if M in (9, 17, 64, 128):  # a row's bits do not depend on how many rows are computed with it
            lib.redrafter_ab_43(1)
            one = gemm(xs[5:9], w)
            assert np.array_equal(one.view(np.int32), b[5:9].view(np.int32)), (M, name)
print("bits: 4 x 3 tiles == 3 x 4 tiles for M = 9..128 and every layer shape; rows 5-8 as computed alone")
for M in (16, 32, 64, 128):
    x = rng.standard_normal((M, 1536), dtype=np.float32)
    total = {0: 0.0, 1: 0.0}
    flops = 0
    for r in range(R):
        for mode in ((0, 1) if r % 2 == 0 else (1, 0)):
            lib.redrafter_ab_43(mode)
            t = time.perf_counter()
            for name, w in weights.items():
                gemm(np.ascontiguousarray(x[:, : w.shape[1]]), w)
            total[mode] += time.perf_counter() - t
    flops = 2 * M * sum(w.size for w in weights.values()) * R
    print(f"M={M}: 3x4 {flops / total[0] / 1e9:.1f} GF/s, 4x3 {flops / total[1] / 1e9:.1f} GF/s, "
          f"4x3 {total[0] / total[1]:.3f}x faster")
