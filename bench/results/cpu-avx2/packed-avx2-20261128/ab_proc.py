"""One process: 8 MT-bench first turns (every tenth), 128 new tokens, greedy fp32: AR, default (auto), drafter alone."""
import sys, time, json
import mlx_redrafter; st = mlx_redrafter.install_blas()
import mlx.core as mx
from mlx_redrafter import api
lm = api.load()
prompts = [json.loads(l)["turns"][0] for l in open("mlx_redrafter/data/mt_bench.jsonl")][::10][:8]
out = {"blas": st.describe(), "packed_target": lm.target.model.compiled.packed_weights is not None}
for mode in ("none", "auto", "rnn"):
    api.generate(lm, prompts[0], draft=mode, max_tokens=16)  # warm
    t = time.perf_counter(); toks = []; calls = 0
    for p in prompts:
        r = api.generate(lm, p, draft=mode, max_tokens=128)
        toks.append(r.tokens); calls += r.stats.steps
    out[mode] = [time.perf_counter() - t, calls, sum(len(x) for x in toks), toks]
json.dump(out, open(sys.argv[1], "w"))
print(out["blas"], out["packed_target"], {m: (round(out[m][0], 2), out[m][1]) for m in ("none", "auto", "rnn")}, flush=True)
