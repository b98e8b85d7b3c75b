import mlx_redrafter
mlx_redrafter.install_blas()
import time, json, sys
import mlx.core as mx
from mlx_redrafter import api
from mlx_redrafter.batch.budget import Budget
lm = api.load()
qs = [json.loads(l)["turns"][0] for l in open("/work/main/mlx_redrafter/data/mt_bench.jsonl")][::5][:16]
B = int(sys.argv[1])
o = api.decode_options(max_tokens=128)
curve = api.cost_curve(lm, B, 4)
_obs = Budget.observe
log = []
def observe(self, lengths, accepted, seconds=None):
    if max(lengths) > 1 or (log and log[-1][0] > len(lengths)):
        pass
    log.append((len(lengths), list(lengths), list(accepted), list(self.kinds), seconds, dict(self.alpha), self.plain.get(len(lengths))))
    return _obs(self, lengths, accepted, seconds)
Budget.observe = observe
api.generate_batch(lm, qs, o, batch_size=B, curve=curve)
for i, (rows, L, acc, kinds, s, alpha, plain) in enumerate(log):
    if max(L) > 1 or (i + 1 < len(log) and max(log[i+1][1]) > 1):
        print(i, rows, L, acc, [k[:7] if k else None for k in kinds], f"{1000*s:.1f}ms", f"plain {1000*(plain or 0):.1f}", {k: round(v, 2) for k, v in alpha.items()})
