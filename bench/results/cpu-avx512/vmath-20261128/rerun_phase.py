import sys, time, json
import mlx_redrafter; st = mlx_redrafter.install_blas()
import mlx.core as mx
from mlx_redrafter import api
from collections import Counter
lm = api.load()
prompts = [json.loads(l)["turns"][0] for l in open("mlx_redrafter/data/mt_bench.jsonl")][::10][:8]
out = {"blas": st.describe()}
for mode in ("none", "rnn"):
    api.generate(lm, prompts[0], draft=mode, max_tokens=16)
    t = time.perf_counter(); calls = 0; ph = Counter()
    for p in prompts:
        r = api.generate(lm, p, draft=mode, max_tokens=128)
        calls += r.stats.steps; ph.update(r.stats.phase_s)
    out[mode] = [round(time.perf_counter() - t, 3), calls, {k: round(v, 3) for k, v in ph.items()}]
print(json.dumps(out))
