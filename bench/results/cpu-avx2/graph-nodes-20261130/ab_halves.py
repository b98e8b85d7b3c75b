import sys, time, json, io, re
sys.path.insert(0, ".")
from mlx_redrafter import install_blas; install_blas()
import mlx.core as mx
from mlx_redrafter.system import vector_math as vm
from mlx_redrafter import api
from mlx_redrafter.options import DecodeOptions
from mlx_redrafter.sweep import decode
from mlx_redrafter.prompts import first_turns
lm = api.load(None, dtype="float32")
model = lm.target.model
real = vm.silu_mul_halves
def use(new):
    vm.silu_mul_halves = real if new else (lambda gu: None)
    model.compile_layers(True)
def nodes():
    c = model.make_cache(400); lg, h = model(mx.array([list(range(100, 400))]), c); mx.eval(lg, h, *c.state())
    lg, h = model(mx.array([[5]]), c); f = io.StringIO(); mx.export_to_dot(f, lg)
    return len(re.findall(r'label ="', f.getvalue()))
for new in (False, True):
    use(new); print("new" if new else "old", "nodes", nodes())
rows = first_turns(); prompts = [rows[i]["prompt"] for i in range(0, 80, 10)]
ids = [api.encode_prompt(lm, p) for p in prompts]
for new in (False, True):
    use(new); decode(lm, ids[0], DecodeOptions(draft="auto", max_tokens=16))
T = {}; toks = {}
for rnd in range(int(sys.argv[1])):
    for i, x in enumerate(ids):
        for draft in ("auto", "none"):
            order = (False, True) if (i + rnd) % 2 == 0 else (True, False)
            for new in order:
                use(new)
                out, st = decode(lm, x, DecodeOptions(draft=draft, max_tokens=128))
                key = (draft, new)
                T[key] = T.get(key, 0) + st.decode_s
                toks.setdefault(key, []).append(tuple(out))
for draft in ("auto", "none"):
    o, n = T[(draft, False)], T[(draft, True)]
    print(draft, "old %.2f s new %.2f s  old/new %.3fx  same ids %s" % (o, n, o / n, toks[(draft, False)] == toks[(draft, True)]))
