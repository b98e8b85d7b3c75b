"""Batched decoding (the server's path), key windows on and off in one process: 12 MT-bench first turns (every
7th), batch_size 4 (rows join as others finish), 96 tokens, greedy, the default mode; rounds alternate the order.
Off = RowsCache.key_windows returning None (the attention of every row from slot 0, as before). Also one row alone
(plain KVCache: no windows), new code only, as a reference. Usage (repository root): batch_ab.py ROUNDS"""
import json, sys, time
from mlx_redrafter import install_blas
install_blas()
from mlx_redrafter import api
from mlx_redrafter.batch.cache import RowsCache
rounds = int(sys.argv[1])
qs = [json.loads(l)["turns"][0] for l in open("../shared/data/mt_bench.jsonl")][::7][:12]
lm = api.load()
on = RowsCache.key_windows
tot = {"on": 0.0, "off": 0.0}
ids = {}
for r in range(rounds + 1):
    for mode in (("on", "off") if r % 2 else ("off", "on")):
        RowsCache.key_windows = on if mode == "on" else (lambda self: None)
        t0 = time.perf_counter()
        res = api.generate_batch(lm, qs, batch_size=4, max_tokens=96, temperature=0.0)
        dt = time.perf_counter() - t0
        ids.setdefault(mode, [x.tokens for x in res])
        if r:
            tot[mode] += dt
        print(r, mode, round(dt, 2), flush=True)
print("same ids:", ids["on"] == ids["off"])
print(f"pooled: off {tot['off']:.1f} s, on {tot['on']:.1f} s, on is {tot['off'] / tot['on']:.3f}x")
