"""Dropping 16 of 64 rows (`select`) and joining 16 new rows of 600 slots (`join_rows`), as the data engine does,
on a cache of 30 layers x 3 KV heads x 64 dims at 600 and 900 slots; one thread. Argument `reuse`: with
`system.memory.reuse_freed_memory` first. Usage (repository root): python relayout_cost.py [reuse]"""
import time
from mlx_redrafter import install_blas
install_blas()
import mlx.core as mx, numpy as np
from mlx_redrafter.system.blas import set_threads
from mlx_redrafter.batch.cache import RowsCache
from mlx_redrafter.cache import KVCache
set_threads(1)
import sys
if len(sys.argv) > 1:
    from mlx_redrafter.system.memory import reuse_freed_memory; print("reuse", reuse_freed_memory())
L, h, D = 30, 3, 64
for S in (600, 900):
    ts = []
    for rep in range(3):
        c = RowsCache(L, S + 256)
        c.keys = [mx.random.normal((64, h, S + 256, D)) for _ in range(L)]
        c.values = [mx.random.normal((64, h, S + 256, D)) for _ in range(L)]
        mx.eval(c.keys, c.values)
        c.valid = np.ones((64, S + 256), bool); c.valid[:, S:] = False; c.offset = S; c.lengths = [S] * 64
        o = KVCache(L, 600); o.keys = [mx.random.normal((16, h, 600, D)) for _ in range(L)]
        o.values = [mx.random.normal((16, h, 600, D)) for _ in range(L)]; o.offset = 600; mx.eval(o.keys, o.values)
        t0 = time.perf_counter()
        c.select(list(range(48)), share=0.0)
        t1 = time.perf_counter()
        c.join_rows(o, np.ones((16, 600), bool), [600] * 16, 256)
        mx.eval(c.keys, c.values)
        t2 = time.perf_counter()
        ts.append((t1 - t0, t2 - t1))
    print(S, "select %.3f s, join %.3f s" % tuple(np.median(np.array(ts), axis=0)))
