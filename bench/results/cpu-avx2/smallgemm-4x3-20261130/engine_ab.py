"""In one process, the greedy data engine's step (`GreedyRows.step`, one BLAS thread) with the committed 3 x 4 tiles
and the 4 x 3 tiles of the A/B library, alternated: R rounds of S steps each, the order flipping every round. One
prompt of CTX random tokens is prefilled once and continued by B rows.
Usage: REDRAFTER_SMALL_GEMM_LIB=ab.so MKL_NUM_THREADS=1 REDRAFTER_THREADS=1 python engine_ab.py B CTX R S"""

import ctypes
import os
import sys
import time

import mlx_redrafter

mlx_redrafter.install_blas()

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from mlx_redrafter.api import load  # noqa: E402
from mlx_redrafter.train.greedy import GreedyRows  # noqa: E402

B, CTX, R, S = (int(a) for a in sys.argv[1:5])
lib = ctypes.CDLL(os.environ["REDRAFTER_SMALL_GEMM_LIB"])
model = load(drafter=None).target.model
engine = GreedyRows(model, 10_000, [0])
engine.add([np.random.default_rng(0).integers(100, 40000, CTX).tolist()], [(0, [])] * B, list(range(B)))
mx.eval(engine.nxt)
for _ in range(3):
    engine.step()
total = {0: 0.0, 1: 0.0}
for r in range(R):
    for mode in ((0, 1) if r % 2 == 0 else (1, 0)):
        lib.redrafter_ab_43(mode)
        engine.step()  # the first step after a switch is not timed
        t = time.perf_counter()
        for _ in range(S):
            engine.step()
        total[mode] += time.perf_counter() - t
n = R * S
print(f"B={B} ctx={CTX}, {R} rounds x {S} steps: 3x4 {1000 * total[0] / n:.0f} ms/step, "
      f"4x3 {1000 * total[1] / n:.0f} ms/step; 4x3 {total[0] / total[1]:.3f}x faster")
