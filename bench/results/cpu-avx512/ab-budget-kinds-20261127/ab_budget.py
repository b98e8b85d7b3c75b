import sys, time, json, importlib.util
import mlx_redrafter; mlx_redrafter.install_blas()
import mlx.core as mx
from mlx_redrafter import api
from mlx_redrafter.batch import loop, budget as newmod
from mlx_redrafter.draft import base
from mlx_redrafter.prompts import first_turns
spec = importlib.util.spec_from_file_location("oldbudget", "/tmp/kb/oldbudget.py"); old = importlib.util.module_from_spec(spec); sys.modules["oldbudget"] = old; spec.loader.exec_module(old)
lm = api.load(None, "default", "float32")
n_prompts = int(sys.argv[3]) if len(sys.argv) > 3 else 16
prompts = [api.encode_prompt(lm, r["prompt"]) for r in first_turns(None, n_prompts, spread=True)]
extra = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
o_spec = api.decode_options(max_tokens=128, **extra); o_plain = api.decode_options(draft="none", max_tokens=128)
curve = newmod.CostCurve.measure(lm.target.model, list(range(1, 9)), o_spec.copy_length, repeats=3)
def old_kind(plan, host):
    if host: return plan[min(host)].source.name
    return base.drafting_kind(plan, host)
new_kind = loop.drafting_kind
def use(which):
    api.Budget = old.Budget if which == "old" else newmod.Budget
    loop.drafting_kind = old_kind if which == "old" else new_kind
cfgs = {"plain": (o_plain, "new"), "old": (o_spec, "old"), "new": (o_spec, "new")}
bs = [int(x) for x in sys.argv[1].split(",")]; rounds = int(sys.argv[2])
tot, ref = {}, {}
for rnd in range(rounds):
    for b in bs:
        for name in (list(cfgs) if rnd % 2 == 0 else list(cfgs)[::-1]):
            o, which = cfgs[name]; use(which)
            mx.clear_cache(); t = time.perf_counter()
            out = api.generate_batch(lm, prompts, o, batch_size=b, curve=curve)
            dt = time.perf_counter() - t; n = sum(len(r.tokens) for r in out); steps = sum(r.stats.steps for r in out)
            ids = [r.tokens for r in out]; ref.setdefault(b, ids)
            tot.setdefault((b, name), []).append((n, dt, steps))
            print(rnd, b, name, round(n / dt, 1), 'tok/row-step', round(n / max(steps, 1), 3), 'same', sum(x == y for x, y in zip(ids, ref[b])), flush=True)
for b in bs:
    d0 = sum(x[1] for x in tot[(b, "plain")])
    for name in cfgs:
        n = sum(x[0] for x in tot[(b, name)]); d = sum(x[1] for x in tot[(b, name)]); s = sum(x[2] for x in tot[(b, name)])
        print(f"B={b} {name:6s} {n/d:7.1f} tok/s  vs plain {d0/d:.3f}  tokens/row-step {n/max(s,1):.3f}  rounds {[round(x[0]/x[1],1) for x in tot[(b, name)]]}")
