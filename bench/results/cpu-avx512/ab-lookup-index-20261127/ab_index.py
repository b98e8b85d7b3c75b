import sys, time, json
import mlx_redrafter; mlx_redrafter.install_blas()
import mlx.core as mx
from mlx_redrafter import api
from mlx_redrafter.prompts import first_turns
lm = api.load(None, "default", "float32")
prompts = [api.encode_prompt(lm, r["prompt"]) for r in first_turns(None, 16, spread=True)]
cfgs = json.loads(sys.argv[1]); rounds = int(sys.argv[2])
opts = {k: api.decode_options(max_tokens=128, **v) for k, v in cfgs.items()}
tot = {}
ref = None
for rnd in range(rounds):
    for name in (list(opts) if rnd % 2 == 0 else list(opts)[::-1]):
        n = steps = 0; dt = 0.0; ids = []
        for p in prompts:
            mx.clear_cache(); t = time.perf_counter()
            r = api.generate(lm, p, opts[name]); dt += time.perf_counter() - t
            n += len(r.tokens); steps += r.stats.steps; ids.append(r.tokens)
        ref = ref or ids
        tot.setdefault(name, []).append((n, dt, steps))
        print(rnd, name, round(n / dt, 1), 't/c', round(n / steps, 3), 'same', sum(a == b for a, b in zip(ids, ref)), flush=True)
d0 = sum(x[1] for x in tot[list(opts)[0]])
for name in opts:
    n = sum(x[0] for x in tot[name]); d = sum(x[1] for x in tot[name]); s = sum(x[2] for x in tot[name])
    print(f"{name:14s} {n/d:6.1f} tok/s  vs first {d0/d:.3f}  t/c {n/s:.3f}  rounds {[round(x[0]/x[1],1) for x in tot[name]]}")
