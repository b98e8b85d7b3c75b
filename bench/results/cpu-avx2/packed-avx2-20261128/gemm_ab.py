"""The 30 layers' weight products (distinct weights) for M rows: our kernel vs the BLAS, alternating; median ms."""
import sys, time, statistics, contextlib
import mlx_redrafter; st = mlx_redrafter.install_blas()
import mlx.core as mx
from mlx_redrafter.system import blas
print(st.describe(), flush=True)
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
W = [mx.random.normal((n, k)) * 0.05 for _ in range(30) for n, k in shapes]
mx.eval(W)
Ms = [int(v) for v in sys.argv[1].split(",")]
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 7
def run(M, on):
    xs = {k: mx.random.normal((M, k)) for k in (576, 1536)}
    mx.eval(xs)
    ctx = contextlib.nullcontext() if on else blas.small_gemm_disabled()
    with ctx:
        t = time.perf_counter()
        ys = [xs[w.shape[1]] @ w.T for w in W]
        mx.eval(ys)
        return (time.perf_counter() - t) * 1e3
for M in Ms:
    a, b = [], []
    for r in range(reps):
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            (a if on else b).append(run(M, on))
    print(M, "kernel", round(statistics.median(a), 1), "blas", round(statistics.median(b), 1), flush=True)
