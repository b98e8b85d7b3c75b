"""The data engine's 64-row step (group 930's replayed slot layouts, key windows on) with the graph-node cuts
switched off and on per call (recompiling the layers), one thread as a data worker has.
Usage (repository root): step64_ab.py REPEATS ../key-windows-20261130/layouts-930.npz"""
import sys, time
from mlx_redrafter import install_blas
install_blas()
sys.path.insert(0, "bench/results/cpu-avx2/graph-nodes-20261130")
from toggles import switch  # noqa: E402
import mlx.core as mx
import numpy as np
from mlx_redrafter.system.blas import set_threads
from mlx_redrafter.models.loader import load_target
from mlx_redrafter.batch.cache import RowsCache
set_threads(1)
reps = int(sys.argv[1])
t = load_target(None, "float32")
m = t.model
def use(new):
    switch(m, new)
z = np.load(sys.argv[2])
L, h, D = m.args.num_hidden_layers, m.args.num_key_value_heads, m.args.head_dim
tot = {False: 0.0, True: 0.0}
for k in sorted(z.files):
    if k[0] != "v":
        continue
    valid, lengths = z[k], z["l" + k[1:]]
    B, S = valid.shape
    cache = RowsCache(L, S + 64)
    cache.keys = [mx.random.normal((B, h, S + 64, D)) for _ in range(L)]
    cache.values = [mx.random.normal((B, h, S + 64, D)) for _ in range(L)]
    mx.eval(cache.keys, cache.values)
    cache.valid = np.pad(valid, [(0, 0), (0, 64)]); cache.offset = S; cache.lengths = lengths.tolist()
    tok = mx.array(np.random.randint(100, 1000, size=(B, 1)), dtype=mx.int32)
    pos = mx.array(lengths, dtype=mx.int32)[:, None]
    times = {False: [], True: []}
    outs = {}
    for rep in range(reps + 1):
        for new in ((False, True) if rep % 2 else (True, False)):
            use(new)
            cache._changes += 1
            mask = mx.concatenate([cache.context_mask(), mx.ones((B, 1), dtype=mx.bool_)], axis=1)[:, None, None]
            t0 = time.perf_counter()
            lg, hd = m(tok, cache, pos, mask)
            mx.eval(lg, hd)
            if rep:
                times[new].append(time.perf_counter() - t0)
            outs[new] = lg
    same = mx.array_equal(outs[False], outs[True]).item()
    med = {c: float(np.median(times[c])) for c in times}
    for c in med: tot[c] += med[c]
    print(f"{k}: B {B} S {S} old {med[False]*1e3:.0f} ms new {med[True]*1e3:.0f} ms same logits {same}", flush=True)
print(f"pooled old/new: {tot[False] / tot[True]:.3f}x")
