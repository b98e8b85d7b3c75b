import sys, time, statistics
sys.path.insert(0, ".")
from mlx_redrafter import install_blas; install_blas()
import mlx.core as mx
from mlx_redrafter import api
from mlx_redrafter.system import packed_linear
K = packed_linear.KERNEL.module
lm = api.load(None, dtype="float32")
model = lm.target.model
ctx = 200
cache = model.make_cache(ctx + 16)
mx.eval(model(mx.zeros((1, ctx), dtype=mx.int32), cache))
cache.advance(ctx)
def fwd(n):
    t = time.perf_counter()
    mx.eval(model(mx.zeros((1, n), dtype=mx.int32), cache)[0])
    return time.perf_counter() - t
res = {}
ref = {}
for n in (1, 2, 3, 4):
    for alt in (0, 1, 2):
        K.set_alt(alt)
        out = model(mx.arange(n, dtype=mx.int32)[None], cache)[0]; mx.eval(out)
        ref.setdefault(n, out)
        assert mx.array_equal(out, ref[n]).item(), (n, alt)
for rep in range(30):
    for n in (2, 3):
        for alt in ((0, 1, 2) if rep % 2 else (2, 1, 0)):
            K.set_alt(alt)
            res.setdefault((n, alt), []).append(fwd(n))
for n in (2, 3):
    print(n, " ".join(f"alt{a}: {1e3*statistics.median(res[(n,a)]):.2f}" for a in (0, 1, 2)))
