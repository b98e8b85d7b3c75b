import time, statistics, sys, importlib
sys.path.insert(0, "/tmp/pkb")
import mlx_redrafter
mlx_redrafter.install_blas()
import mlx.core as mx
from mlx_redrafter import api
lm = api.load(None, "default", "float32")
mods = {n: importlib.import_module(n) for n in sys.argv[1].split(",")}
for m in mods.values(): m.set_threads(2); m.set_isa("best")
emb = lm.target.model.model.embed_tokens
pk = emb.packed
layers = lm.target.model.model.layers
qk = [l.self_attn.qkv.packed for l in layers] + [l.mlp.gate_up.packed for l in layers] + [l.mlp.down.packed for l in layers] + [l.self_attn.o.packed for l in layers]
Ms = [int(x) for x in sys.argv[2].split(",")]
what = sys.argv[3] if len(sys.argv) > 3 else "head"
res = {}
for rep in range(25):
    for M in Ms:
        x = mx.random.normal((M, 576)); x2 = mx.random.normal((M, 1536)); mx.eval(x, x2)
        for name, mod in mods.items():
            s = time.perf_counter()
            if what == "head":
                mx.eval(mod.quantized_linear(x, pk.weight, pk.scales, pk.biases, 8, pk.group_size))
            else:
                mx.eval([mod.quantized_linear(x2 if p.weight.shape[1] * 8 == 1536 else x, p.weight, p.scales, p.biases, 4, p.group_size) for p in qk])
            res.setdefault((M, name), []).append(time.perf_counter() - s)
for M in Ms:
    print(f"M={M}: " + "  ".join(f"{n} {statistics.median(res[(M, n)][3:])*1e3:.2f}" for n in mods))
