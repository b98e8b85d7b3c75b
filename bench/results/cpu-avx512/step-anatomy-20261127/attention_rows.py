import mlx_redrafter
mlx_redrafter.install_blas()
import time
import mlx.core as mx
from mlx_redrafter.model import attention
def bench(B, N, S, reps=20):
    qs = [mx.random.normal((B, 9, N, 64)) for _ in range(30)]
    ks = [mx.random.normal((B, 3, S, 64)) for _ in range(30)]
    vs = [mx.random.normal((B, 3, S, 64)) for _ in range(30)]
    mask = mx.ones((B, 1, N, S), dtype=mx.bool_)
    mx.eval(qs, ks, vs, mask)
    ts = []
    for r in range(reps):
        t = time.perf_counter()
        outs = [attention(q, k, v, 0.125, mask) for q, k, v in zip(qs, ks, vs)]
        mx.eval(outs)
        ts.append(time.perf_counter() - t)
    ts.sort()
    return 1000 * ts[len(ts)//2]
for B, N, S in [(1,1,300),(1,3,300),(1,4,300),(4,1,300),(4,2,300),(4,3,300),(8,1,300),(8,2,300),(1,1,600),(4,1,600)]:
    print(B, N, S, round(bench(B, N, S), 2), "ms / 30 layers")
