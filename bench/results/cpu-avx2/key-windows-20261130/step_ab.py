import sys, time
from mlx_redrafter import install_blas
install_blas()
import mlx.core as mx
import numpy as np
from mlx_redrafter.system.blas import set_threads
from mlx_redrafter.models.loader import load_target
import mlx_redrafter.batch.cache as bc
from mlx_redrafter.batch.cache import RowsCache
set_threads(int(sys.argv[1]))
reps = int(sys.argv[2])  # usage: step_ab.py THREADS REPEATS LAYOUTS.npz
t = load_target(None, "float32")
m = t.model
z = np.load(sys.argv[3])
L, h, D = m.args.num_hidden_layers, m.args.num_key_value_heads, m.args.head_dim
orig = RowsCache.key_windows
modes = [0, 256, 1024, 4096]
tot = {c: 0.0 for c in modes}
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
    times = {c: [] for c in modes}
    nw = {}
    for rep in range(reps + 1):
        order = modes if rep % 2 else modes[::-1]
        for c in order:
            bc.WINDOW_COST = c
            cache._changes += 1
            RowsCache.key_windows = orig if c else (lambda self: None)
            w = cache.key_windows(); nw[c] = len(w) if w else 1
            mask = mx.concatenate([cache.context_mask(), mx.ones((B, 1), dtype=mx.bool_)], axis=1)[:, None, None]
            t0 = time.perf_counter()
            lg, hd = m(tok, cache, pos, mask)
            mx.eval(lg, hd)
            if rep:
                times[c].append(time.perf_counter() - t0)
    med = {c: float(np.median(times[c])) for c in modes}
    for c in modes: tot[c] += med[c]
    print(f"{k}: B {B} S {S} valid {valid.mean():.2f} " + ", ".join(f"{c}: {med[c]*1e3:.0f} ms ({nw[c]})" for c in modes), flush=True)
print("pooled vs whole: " + ", ".join(f"{c}: {tot[0]/tot[c]:.3f}x" for c in modes[1:]))
