"""Kept-quantized forwards of R rows: the packed kernel (any rows) vs the weights dequantized for the product."""
import math, time
from mlx_redrafter import install_blas
install_blas()
import mlx.core as mx, numpy as np
from mlx_redrafter import api, model as M
q = api.load(None, drafter="none", dtype="quantized").target.model
f = api.load(None, drafter="none", dtype="float32").target.model
LIMIT = [6]
M.PackedWeights.takes = staticmethod(lambda x, *_: math.prod(x.shape[:-1]) <= LIMIT[0])
ctx = mx.array([list(range(100, 300))])
res = {}
for r in range(7):
    for n in (4, 6, 8, 12, 16, 24, 32, 48, 64, 128):
        for name, m, lim in (("kernel", q, 10**6), ("dequant", q, 0), ("float32", f, 6)):
            LIMIT[0] = lim
            c = m.make_cache(512); mx.eval(m(ctx, c)[0])
            t = time.perf_counter(); mx.eval(m(mx.array([[5] * n]), c)[0]); res.setdefault((n, name), []).append(time.perf_counter() - t)
for n in (4, 6, 8, 12, 16, 24, 32, 48, 64, 128):
    print(n, *(f"{k} {np.median(res[(n, k)]) * 1e3:.1f}" for k in ("kernel", "dequant", "float32")))
