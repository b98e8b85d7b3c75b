import sys, time, json
import mlx_redrafter; mlx_redrafter.install_blas()
import mlx.core as mx
from mlx_redrafter import api
from mlx_redrafter.prompts import first_turns
from mlx_redrafter.batch.budget import CostCurve
from mlx_redrafter.system import packed_linear
print("kernel", packed_linear.__file__, packed_linear.VERSION, flush=True)
lm = api.load(None, "default", "float32")
prompts = [api.encode_prompt(lm, r["prompt"]) for r in first_turns(None, 16, spread=True)]
opts = {"plain": api.decode_options(max_tokens=128, draft="none"), "spec": api.decode_options(max_tokens=128)}
curve = CostCurve.measure(lm.target.model, list(range(1, 9)), max(o.copy_length for o in opts.values()), repeats=3)
print("curve B=4:", [round(s * 1e3, 1) for s in curve.seconds[4]], "B=8:", [round(s * 1e3, 1) for s in curve.seconds[8]], flush=True)
res = {}
for b in [1, 2, 4, 8]:
    for name, o in opts.items():
        mx.clear_cache(); t = time.perf_counter()
        out = api.generate_batch(lm, prompts, o, batch_size=b, curve=curve)
        dt = time.perf_counter() - t; n = sum(len(r.tokens) for r in out)
        res[f"{b}-{name}"] = dict(n=n, dt=dt, ids=[r.tokens for r in out])
        print(b, name, round(n / dt, 1), flush=True)
json.dump(res, open(sys.argv[1], "w"))
