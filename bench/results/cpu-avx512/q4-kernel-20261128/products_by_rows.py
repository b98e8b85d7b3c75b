import time, sys, os
import mlx_redrafter
st = mlx_redrafter.install_blas()
import mlx.core as mx
from mlx_redrafter.system import packed_linear as pl
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
ws = []
for N, K in shapes:
    w = mx.random.normal((N, K)) * 0.05
    q, s, b = mx.quantize(w, group_size=32, bits=4)
    s, b = s.astype(mx.float32), b.astype(mx.float32)
    mx.eval(q, s, b)
    ws.append([(mx.array(q), mx.array(s), mx.array(b)) for _ in range(30)] + [N, K])
def run(M, reps=10):
    xs = [mx.random.normal((M, item[-1])) for item in ws]; mx.eval(xs)
    def once():
        outs = []
        for l in range(30):
            for x, item in zip(xs, ws):
                q, s, b = item[l]
                outs.append(pl.quantized_product(x, q, s, b, 4, 32))
        mx.eval(outs)
    once()
    t = time.perf_counter()
    for _ in range(reps): once()
    return (time.perf_counter() - t) / reps
Ms = [1, 2, 3, 4, 5, 6, 8]
res = {m: [] for m in Ms}
for r in range(3):
    for M in Ms:
        res[M].append(run(M))
for M in Ms:
    tp = min(res[M])
    fl = sum(2 * M * item[-2] * item[-1] for item in ws) * 30
    print(f"M={M}: packed {tp*1e3:.2f} ms ({' '.join(f'{t*1e3:.2f}' for t in res[M])})  {fl/tp/1e9:.0f} GFLOP/s", flush=True)
