import mlx_redrafter
mlx_redrafter.install_blas()
import time, json, sys
import mlx.core as mx
from mlx_redrafter import api
import mlx_redrafter.batch.budget as BU
lm = api.load()
qs = [json.loads(l)["turns"][0] for l in open("/work/main/mlx_redrafter/data/mt_bench.jsonl")][::5][:16]
Bs = [int(x) for x in sys.argv[1].split(",")]; rounds = int(sys.argv[2]); margins = [float(x) for x in sys.argv[3].split(",")]
o = api.decode_options(max_tokens=128); plain = api.decode_options(max_tokens=128, draft="none")
ref = {}; tot = {}
init = BU.Budget.__init__
for rnd in range(rounds):
    for B in Bs:
        curve = api.cost_curve(lm, B, 4)
        names = ["plain"] + [f"m{m}" for m in margins]
        k = rnd % len(names)
        for name in names[k:] + names[:k]:
            if name != "plain":
                m = float(name[1:])
                BU.Budget.__init__ = lambda self, *a, _m=m, **kw: init(self, *a, **{**kw, "margin": _m})
            t = time.perf_counter()
            res = api.generate_batch(lm, qs, plain if name == "plain" else o, batch_size=B, curve=curve)
            s = time.perf_counter() - t
            ids = [r.tokens for r in res]
            ref.setdefault(B, ids)
            same = sum(a == b for a, b in zip(ids, ref[B]))
            tot[(B, name)] = tot.get((B, name), 0) + s
            print(rnd, B, name, f"{s:.2f}s", f"ids={same}/16", flush=True)
for B in Bs:
    print(B, {n: round(tot[(B, 'plain')] / v, 3) for (b, n), v in tot.items() if b == B and n != "plain"})
