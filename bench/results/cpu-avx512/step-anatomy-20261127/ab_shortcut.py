import mlx_redrafter
mlx_redrafter.install_blas()
import time, json, sys, importlib.util
import mlx.core as mx
from mlx_redrafter import api
import mlx_redrafter.batch.loop as BL
import mlx_redrafter.batch.step as NEW
spec = importlib.util.spec_from_file_location("oldstep", "/tmp/kb/oldstep.py"); OLD = importlib.util.module_from_spec(spec); sys.modules["oldstep"] = OLD; spec.loader.exec_module(OLD)
lm = api.load()
qs = [json.loads(l)["turns"][0] for l in open("/work/main/mlx_redrafter/data/mt_bench.jsonl")][::5][:16]
Bs = [int(x) for x in sys.argv[1].split(",")]; rounds = int(sys.argv[2])
o = api.decode_options(max_tokens=128); plain = api.decode_options(max_tokens=128, draft="none")
ref = {}
CNT = {"spec": 0, "plain": 0}
_plain = BL.Batch._plain
def counted_plain(self, seqs):
    CNT["plain"] += 1
    return _plain(self, seqs)
BL.Batch._plain = counted_plain
def counting(f):
    def g(*a, **k):
        CNT["spec"] += 1
        return f(*a, **k)
    return g
tot = {}
for rnd in range(rounds):
    for B in Bs:
        curve = api.cost_curve(lm, B, 4) if not __import__("os").environ.get("NOCURVE") else None
        names = ["plain", "old", "new"]
        for name in names[rnd % 3:] + names[:rnd % 3]:
            BL.speculative_step = counting((OLD if name == "old" else NEW).speculative_step)
            CNT.update(spec=0, plain=0)
            t = time.perf_counter()
            res = api.generate_batch(lm, qs, plain if name == "plain" else o, batch_size=B, curve=curve)
            s = time.perf_counter() - t
            ids = [r.tokens for r in res]
            ref.setdefault(B, ids)
            same = sum(a == b for a, b in zip(ids, ref[B]))
            tot[(B, name)] = tot.get((B, name), 0) + s
            print(rnd, B, name, f"{s:.2f}s", f"ids={same}/16", CNT, flush=True)
for B in Bs:
    print(B, "old/plain", round(tot[(B,'plain')]/tot[(B,'old')], 3), "new/plain", round(tot[(B,'plain')]/tot[(B,'new')], 3))
