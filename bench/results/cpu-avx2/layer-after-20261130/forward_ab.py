"""One-token and four-token forwards after a 200-token prefill, `layer_after` on and off alternating in one process:
wall time and the Python build time. Usage (repository root): forward_ab.py"""
import sys, time
sys.path.insert(0, ".")
from mlx_redrafter import install_blas; install_blas()
import mlx.core as mx
from mlx_redrafter import api
from mlx_redrafter.model import forward_chunked
lm = api.load(None, dtype="float32")
model = lm.target.model
c = model.make_cache(1024); lg, h = forward_chunked(model, c, mx.array([[1] * 200])); mx.eval(lg, h)
for N in (1, 4):
    res = {True: [], False: []}; build = {True: [], False: []}
    for it in range(80):
        for fuse in ((True, False) if it % 2 else (False, True)):
            model.compiled.fuse = fuse
            t0 = time.perf_counter(); o = model(mx.array([[5] * N]), c); t1 = time.perf_counter(); mx.eval(o)
            res[fuse].append(time.perf_counter() - t0); build[fuse].append(t1 - t0)
    for f in (False, True):
        r = sorted(res[f]); b = sorted(build[f])
        print(f"N={N} fused={f}: p25 {r[20]*1e3:.2f} p50 {r[40]*1e3:.2f} min {r[0]*1e3:.2f} mean {sum(r)/len(r)*1e3:.2f} ms; build p50 {b[40]*1e3:.2f}")
