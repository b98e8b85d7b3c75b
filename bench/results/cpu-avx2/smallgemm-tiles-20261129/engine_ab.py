"""In one process, the greedy data engine's step (`GreedyRows.step`, one BLAS thread) with the previous AVX2 path
for more than 8 rows ("old"), this commit's tiles ("new") and the kernel off ("blas": MKL for every product, whose
bits depend on the number of rows), alternated: R rounds of S steps each, the order rotating every round. One prompt
of CTX random tokens is prefilled once and continued by B rows (the arithmetic of B different prompts).
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


def use(mode: str) -> None:
    lib.redrafter_ab_old(int(mode == "old"))
    lib.redrafter_gemm_enable(int(mode != "blas"))


modes = ["old", "new", "blas"]
total = dict.fromkeys(modes, 0.0)
for r in range(R):
    for mode in modes[r % 3:] + modes[: r % 3]:
        use(mode)
        engine.step()  # the first step after a switch is not timed
        t = time.perf_counter()
        for _ in range(S):
            engine.step()
        total[mode] += time.perf_counter() - t
use("new")
n = R * S
print(f"B={B} ctx={CTX}, {R} rounds x {S} steps: " + ", ".join(
    f"{m} {1000 * total[m] / n:.0f} ms/step" for m in modes)
    + f"; old/new {total['old'] / total['new']:.3f}x, blas/new {total['blas'] / total['new']:.3f}x")
