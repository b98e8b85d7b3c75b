"""Batched decoding (the server's path) with the graph-node cuts off and on in one process (recompiling the layers):
12 MT-bench first turns (every 7th), batch_size 4 (rows join as others finish), 96 tokens, greedy, the default
mode; rounds alternate the order. Ragged steps (rows verifying different numbers of tokens) take the rope/layout
kernel with their spread index. Usage (repository root): batch_ab.py ROUNDS"""
import json, sys, time
from mlx_redrafter import install_blas
install_blas()
import mlx.core as mx
import mlx_redrafter.model as M
from mlx_redrafter.system import vector_math as vm, attention_kernel as ak
from mlx_redrafter import api
rounds = int(sys.argv[1])
qs = [json.loads(l)["turns"][0] for l in open("../shared/data/mt_bench.jsonl")][::7][:12]
lm = api.load()
model = lm.target.model
new_fns = dict(norm=vm.rms_norm, silu=vm.silu_mul_halves, rope=ak.heads_rope, rms=M.rms_norm, tok=M.tokens_of)
def old_tok(out, gather=None):
    B, h, N, D = out.shape
    out = out.transpose(0, 2, 1, 3).reshape(B * N, h * D)
    return out if gather is None else out[gather]
def use(new):
    vm.rms_norm = new_fns["norm"] if new else (lambda x, w, eps: None)
    vm.silu_mul_halves = new_fns["silu"] if new else (lambda gu: None)
    ak.heads_rope = new_fns["rope"] if new else (lambda *a: None)
    M.rms_norm = new_fns["rms"] if new else (lambda x, w, eps: mx.fast.rms_norm(x, w, eps) if w is None else new_fns["rms"](x, w, eps))
    M.tokens_of = new_fns["tok"] if new else old_tok
    model.compile_layers(True)
tot = {"new": 0.0, "old": 0.0}
ids = {}
for r in range(rounds + 1):
    for mode in (("new", "old") if r % 2 else ("old", "new")):
        use(mode == "new")
        t0 = time.perf_counter()
        res = api.generate_batch(lm, qs, batch_size=4, max_tokens=96, temperature=0.0)
        dt = time.perf_counter() - t0
        ids.setdefault(mode, [x.tokens for x in res])
        if r:
            tot[mode] += dt
        print(r, mode, round(dt, 2), flush=True)
print(f"pooled old/new: {tot['old'] / tot['new']:.3f}x  same ids: {ids['old'] == ids['new']}")
