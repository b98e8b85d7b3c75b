import sys, time, json, io, re
sys.path.insert(0, ".")
from mlx_redrafter import install_blas; install_blas()
import mlx.core as mx
import mlx_redrafter.model as M
from mlx_redrafter.system import vector_math as vm, attention_kernel as ak, packed_linear as pl
from mlx_redrafter import api
from mlx_redrafter.options import DecodeOptions
from mlx_redrafter.sweep import decode
from mlx_redrafter.prompts import first_turns
lm = api.load(None, dtype="float32")
model = lm.target.model
new_fns = dict(norm=vm.rms_norm, silu=vm.silu_mul_halves, rope=ak.heads_rope, rms=M.rms_norm, qp=pl.quantized_product, tok=M.tokens_of)
def old_qp(x, weight, scales, biases, bits, group_size):
    shape = x.shape
    y = pl.KERNEL.module.quantized_linear(x.reshape(-1, shape[-1]), weight, scales, biases, bits, group_size)
    return y.reshape(*shape[:-1], weight.shape[0])
def old_rms(x, weight, eps):  # the taps through MLX's fallback
    return mx.fast.rms_norm(x, weight, eps) if weight is None else new_fns["rms"](x, weight, eps)
def old_tok(out, gather=None):
    B, h, N, D = out.shape
    out = out.transpose(0, 2, 1, 3).reshape(B * N, h * D)
    return out if gather is None else out[gather]
ONLY = sys.argv[2] if len(sys.argv) > 2 else "all"  # the change switched: norm, silu, rope, rest (reshapes, taps) or all
CHANGES = {"norm", "silu", "rope", "rest"} if ONLY == "all" else {ONLY}


def use(new):
    def on(change):
        return new or change not in CHANGES
    vm.rms_norm = new_fns["norm"] if on("norm") else (lambda x, w, eps: None)
    vm.silu_mul_halves = new_fns["silu"] if on("silu") else (lambda gu: None)
    ak.heads_rope = new_fns["rope"] if on("rope") else (lambda *a: None)
    M.rms_norm = new_fns["rms"] if on("rest") else old_rms
    pl.quantized_product = new_fns["qp"] if on("rest") else old_qp
    M.tokens_of = new_fns["tok"] if on("rest") else old_tok
    model.compile_layers(True)
def nodes(N):
    c = model.make_cache(400); lg, h = model(mx.array([list(range(100, 400))]), c); mx.eval(lg, h, *c.state())
    lg, h = model(mx.array([[5] * N]), c); f = io.StringIO(); mx.export_to_dot(f, lg, h)
    return len(re.findall(r'label ="', f.getvalue()))
for new in (False, True):
    use(new); print("new" if new else "old", "nodes N=1", nodes(1), "N=3", nodes(3), flush=True)
rows = first_turns(); prompts = [rows[i]["prompt"] for i in range(0, 80, 10)]
ids = [api.encode_prompt(lm, p) for p in prompts]
for new in (False, True):
    use(new); decode(lm, ids[0], DecodeOptions(draft="auto", max_tokens=16))
T = {}; toks = {}; calls = {}
for rnd in range(int(sys.argv[1])):
    for i, x in enumerate(ids):
        for draft in ("auto", "none"):
            order = (False, True) if (i + rnd) % 2 == 0 else (True, False)
            for new in order:
                use(new)
                out, st = decode(lm, x, DecodeOptions(draft=draft, max_tokens=128))
                key = (draft, new)
                T[key] = T.get(key, 0) + st.decode_s
                calls[key] = calls.get(key, 0) + st.steps
                toks.setdefault(key, []).append(tuple(out))
    print("round", rnd, {f"{d}-{'new' if n else 'old'}": round(v, 2) for (d, n), v in T.items()}, flush=True)
for draft in ("auto", "none"):
    o, n = T[(draft, False)], T[(draft, True)]
    ntok = sum(len(t) for t in toks[(draft, True)])
    print(draft, "old %.2f s new %.2f s  old/new %.3fx  same ids %s  tokens %d  calls %d" % (o, n, o / n, toks[(draft, False)] == toks[(draft, True)], ntok, calls[(draft, True)]))
print("default vs AR: old %.3fx new %.3fx" % (T[("none", False)] / T[("auto", False)], T[("none", True)] / T[("auto", True)]))
