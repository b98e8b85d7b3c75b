"""One W1 L4 drafting call (greedy_draft, 3 drafted tokens) from a real context: the drafter's float16 copies vs its
float32 weights, alternating; median ms."""
import time, statistics, json
import mlx_redrafter; mlx_redrafter.install_blas()
import mlx.core as mx
from mlx_redrafter import api
from mlx_redrafter.step import prefill
from mlx_redrafter.draft.beam_search import greedy_draft
from mlx_redrafter.system import packed_linear as pl
lm = api.load()
m = lm.target.model
p = [json.loads(l)["turns"][0] for l in open("mlx_redrafter/data/mt_bench.jsonl")][0]
ids = api.encode_prompt(lm, p, True)
cache = m.make_cache(1024)
g0, h = prefill(m, cache, ids); mx.eval(g0, h)
def one(half):
    kept = pl.KERNEL.module
    if not half: pl.KERNEL.module = None
    try:
        t = time.perf_counter(); d = greedy_draft(lm.drafter, m.embed, h, g0, 4); mx.eval(d)
        return (time.perf_counter() - t) * 1e3, d
    finally:
        pl.KERNEL.module = kept
a, b = [], []
for r in range(41):
    for half in ((True, False) if r % 2 else (False, True)):
        dt, d = one(half); (a if half else b).append(dt)
print("float16 copies", round(statistics.median(a), 2), "float32", round(statistics.median(b), 2),
      "same drafts", mx.array_equal(one(True)[1], one(False)[1]).item())
