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
    wt = mx.dequantize(q, s, b, group_size=32, bits=4)
    mx.eval(q, s, b, wt)
    ws.append([(mx.array(q), mx.array(s), mx.array(b), mx.array(wt) * 1) for _ in range(30)] + [N, K])
def run(M, packed, reps=6):
    xs = [mx.random.normal((M, item[-1])) for item in ws]; mx.eval(xs)
    def once():
        outs = []
        for l in range(30):
            for x, item in zip(xs, ws):
                q, s, b, wt = item[l]
                outs.append(pl.quantized_product(x, q, s, b, 4, 32) if packed else x @ wt.T)
        mx.eval(outs)
    once()
    t = time.perf_counter()
    for _ in range(reps): once()
    return (time.perf_counter() - t) / reps
Ms = [int(a) for a in sys.argv[1].split(",")]
res = {(m, p): [] for m in Ms for p in (0, 1)}
for r in range(2):
    for M in Ms:
        for p in (1, 0):
            res[(M, p)].append(run(M, p))
for M in Ms:
    print(f"M={M}: packed {min(res[(M,1)])*1e3:.2f} ms  fp32 {min(res[(M,0)])*1e3:.2f} ms", flush=True)
