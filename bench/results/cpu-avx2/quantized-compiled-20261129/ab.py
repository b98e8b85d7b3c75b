"""Quantized model on a CPU: compiled layers on vs off, same process, interleaved (one-token and 4-token forwards
after a 200-token context; then whole decodes of MT-bench first turns)."""
import sys, time, json
from mlx_redrafter import install_blas
install_blas()
import mlx.core as mx, numpy as np
from mlx_redrafter import api
from mlx_redrafter.prompts import first_turns

lm = api.load(None, dtype="quantized")
m = lm.target.model
def fwd(n, reps=30):
    res = {True: [], False: []}
    ctx = mx.array([list(range(100, 300))])
    for r in range(reps):
        for on in (True, False) if r % 2 else (False, True):
            m.compile_layers(on)
            c = m.make_cache(256)
            mx.eval(m(ctx, c)[0])
            t = time.perf_counter(); mx.eval(m(mx.array([[5] * n]), c)[0]); res[on].append(time.perf_counter() - t)
    return {k: float(np.median(v) * 1e3) for k, v in res.items()}
print("forward 1 token ms (compiled, modules):", fwd(1))
print("forward 4 tokens ms (compiled, modules):", fwd(4))
prompts = [r["prompt"] for r in first_turns()][:8]
tot = {True: 0.0, False: 0.0}; same = True
for rep in range(2):
    for i, p in enumerate(prompts):
        outs = {}
        for on in (True, False) if (i + rep) % 2 else (False, True):
            m.compile_layers(on)
            t = time.perf_counter(); outs[on] = api.generate(lm, p, max_tokens=64, draft="auto").tokens
            tot[on] += time.perf_counter() - t
        same &= outs[True] == outs[False]
print(json.dumps({"compiled_s": tot[True], "modules_s": tot[False], "ratio": tot[False] / tot[True], "same_tokens": same}))
