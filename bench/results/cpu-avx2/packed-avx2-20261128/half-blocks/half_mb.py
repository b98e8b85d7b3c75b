import time, statistics
import mlx_redrafter; mlx_redrafter.install_blas()
import mlx.core as mx
from mlx_redrafter.system import packed_linear as pl
for N, K in ((8192, 576), (576, 576), (576, 1152)):
    w32 = mx.random.normal((N, K)) * 0.05; w = w32.astype(mx.float16); x = mx.random.normal((1, K)); mx.eval(w, w32, x)
    a, b = [], []
    for r in range(30):
        t = time.perf_counter(); mx.eval(pl.half_product(x, w)); a.append((time.perf_counter() - t) * 1e3)
        t = time.perf_counter(); mx.eval(x @ w32.T); b.append((time.perf_counter() - t) * 1e3)
    print(N, K, "half", round(statistics.median(a), 3), "f32", round(statistics.median(b), 3))
