"""Batched decoding (the server's path) with the graph-node cuts off and on in one process (recompiling the layers):
12 MT-bench first turns (every 7th), batch_size 4 (rows join as others finish), 96 tokens, greedy, the default
mode; rounds alternate the order. Ragged steps (rows verifying different numbers of tokens) take the rope/layout
kernel with their spread index. Usage (repository root): batch_ab.py ROUNDS"""
import json, sys, time
from mlx_redrafter import install_blas
install_blas()
sys.path.insert(0, "bench/results/cpu-avx2/graph-nodes-20261130")
from toggles import switch  # noqa: E402
import mlx.core as mx
from mlx_redrafter import api
rounds = int(sys.argv[1])
qs = [json.loads(l)["turns"][0] for l in open("../shared/data/mt_bench.jsonl")][::7][:12]
lm = api.load()
model = lm.target.model
def use(new):
    switch(model, new)
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
