"""Float32 model forward of R tokens after 200 tokens of context: packed kernel vs dense old kernels vs dense tiles."""
import ctypes, os, sys, time
import mlx_redrafter
mlx_redrafter.install_blas()
import mlx.core as mx, numpy as np
from mlx_redrafter import api
from mlx_redrafter.system import packed_linear
lib = ctypes.CDLL(os.environ["REDRAFTER_SMALL_GEMM_LIB"])
lib.redrafter_ab_tiles_from.argtypes = [ctypes.c_int, ctypes.c_long]
m = api.load(None, drafter="none", dtype="float32").target.model
isa = packed_linear.KERNEL.isa
ctx = mx.array([list(range(100, 300))])
def mode(name):
    packed_linear.MAX_ROWS[isa] = 8 if name == "packed" else 0
    lib.redrafter_ab_tiles_from(2 if name == "tiles" else 9, int(sys.argv[1]) if len(sys.argv) > 1 else 4000000)
res = {}
names = ["packed", "old", "tiles"]
NS = (1, 2, 3, 4, 5, 6, 7, 8)
for r in range(int(sys.argv[2]) if len(sys.argv) > 2 else 7):
    for n in NS:
        for name in names[r % 3:] + names[:r % 3]:
            mode(name)
            c = m.make_cache(512); mx.eval(m(ctx, c)[0])
            t = time.perf_counter(); mx.eval(m(mx.array([[5] * n]), c)[0]); res.setdefault((n, name), []).append(time.perf_counter() - t)
for n in NS:
    print(n, *(f"{k} {np.median(res[(n, k)]) * 1e3:.1f}" for k in names))
