"""A forward of N tokens after a 200-token prefill against the same products alone (the 120 packed layer products
and the vocabulary's, each a node of its own), alternating in one process. Usage (repository root): products_share.py N"""
import sys, time
sys.path.insert(0, ".")
from mlx_redrafter import install_blas; install_blas()
import mlx.core as mx
from mlx_redrafter import api
from mlx_redrafter.system import packed_linear
from mlx_redrafter.model import forward_chunked
lm = api.load(None, dtype="float32")
model = lm.target.model
pw = model.compiled.packed_weights
c = model.make_cache(1024); lg, h = forward_chunked(model, c, mx.array([[1] * 200])); mx.eval(lg, h)
NN = int(sys.argv[1]); xs = {576: mx.random.normal((NN, 576)), 1536: mx.random.normal((NN, 1536))}; mx.eval(xs)
post = mx.random.normal((1, NN, 576)); mx.eval(post)
def prods():
    outs = []
    for L in range(30):
        for i in (1, 2, 4, 5):
            w = pw[L][i]; outs.append(packed_linear.quantized_product(xs[w[0].shape[1] * 8], *w, 4, 32))
    outs.append(model.logits(post))
    return outs
def fwd(): return model(mx.array([[5] * NN]), c)
R = {"fwd": [], "prods": []}
for it in range(60):
    for name, f in (("fwd", fwd), ("prods", prods)) if it % 2 else (("prods", prods), ("fwd", fwd)):
        t0 = time.perf_counter(); mx.eval(f()); R[name].append(time.perf_counter() - t0)
for k, r in R.items():
    r.sort(); print(k, f"mean {sum(r)/len(r)*1e3:.2f} p50 {r[30]*1e3:.2f} min {r[0]*1e3:.2f}")
