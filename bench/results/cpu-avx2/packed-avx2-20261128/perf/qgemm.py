"""The 30 layers' products from 4-bit packed weights (distinct weights) + the 8-bit vocabulary, M rows; median ms."""
import sys, time, statistics
import mlx_redrafter; st = mlx_redrafter.install_blas()
import mlx.core as mx
from mlx_redrafter.system import packed_linear as pl
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
Q = []
for _ in range(30):
    for n, k in shapes:
        w = (mx.random.normal((n, k)) * 0.05).astype(mx.float16)
        q, s, b = mx.quantize(w, group_size=32, bits=4)
        Q.append((q, s.astype(mx.float32), b.astype(mx.float32), 4, k))
wv = (mx.random.normal((49152, 576)) * 0.05).astype(mx.float16)
q, s, b = mx.quantize(wv, group_size=32, bits=8)
V = (q, s.astype(mx.float32), b.astype(mx.float32), 8, 576)
mx.eval([x[:3] for x in Q], V[:3])
for M in [int(v) for v in sys.argv[1].split(",")]:
    xs = {k: mx.random.normal((M, k)) for k in (576, 1536)}; mx.eval(xs)
    a, v = [], []
    for r in range(7):
        t = time.perf_counter()
        mx.eval([pl.quantized_product(xs[k], q, s, b, bits, 32) for q, s, b, bits, k in Q])
        a.append((time.perf_counter() - t) * 1e3)
        t = time.perf_counter()
        mx.eval(pl.quantized_product(xs[576], V[0], V[1], V[2], 8, 32))
        v.append((time.perf_counter() - t) * 1e3)
    print(M, "layers", round(statistics.median(a), 2), "vocab", round(statistics.median(v), 2), flush=True)
