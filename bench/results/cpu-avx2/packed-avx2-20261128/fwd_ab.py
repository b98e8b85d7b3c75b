"""Forward of N tokens after a 200-token prefill, packed weights vs float32 copies, alternating; median ms."""
import sys, time, json, statistics
import mlx_redrafter; st = mlx_redrafter.install_blas()
import mlx.core as mx
from mlx_redrafter.system import packed_linear as pl
from mlx_redrafter.models.loader import load_target
t = load_target(None, "float32")
m = t.model
print(st.describe(), pl.KERNEL.isa, "packed:", m.compiled.packed_weights is not None, flush=True)
ids = list(range(1000, 1200))
cache = m.make_cache(512)
m(mx.array([ids]), cache); cache.advance(200)
Ns = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "1,2,3,4,5,8,12,16").split(",")]
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 9
res = {}
def one(n, packed):
    kept = pl.KERNEL.module
    if not packed: pl.KERNEL.module = None
    try:
        x = mx.array([ids[:n]])
        t0 = time.perf_counter(); out = m(x, cache); mx.eval(out); dt = time.perf_counter() - t0
    finally:
        pl.KERNEL.module = kept
    return dt, out
for n in Ns:
    a, b = [], []
    for r in range(reps):
        for packed in ((True, False) if r % 2 == 0 else (False, True)):
            dt, out = one(n, packed)
            (a if packed else b).append(dt * 1e3)
    # same bits?
    _, o1 = one(n, True); _, o2 = one(n, False)
    same = all(mx.array_equal(p, q).item() for p, q in zip(o1, o2))
    res[n] = (round(statistics.median(a), 2), round(statistics.median(b), 2), same)
    print(n, res[n], flush=True)
