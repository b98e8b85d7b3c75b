"""make_group on a copy of the corpus for N steps: 'new' (key windows + reused memory) or 'old' (neither)."""
# Usage (repository root): engine_ab.py old|new STEPS FIRST_SHARD CORPUS_COPY_DIR
import sys, time, json
from mlx_redrafter import install_blas
install_blas()
import mlx.core as mx
from pathlib import Path
from mlx_redrafter.system.blas import set_threads
from mlx_redrafter.models.loader import load_target
from mlx_redrafter.train.greedy import GreedySource, GreedyRows
from mlx_redrafter.train.pipeline import open_corpus
from mlx_redrafter.batch.cache import RowsCache
mode, N, first, root = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
set_threads(1)
if mode == "new":
    from mlx_redrafter.system.memory import reuse_freed_memory
    reuse_freed_memory()
else:
    RowsCache.key_windows = lambda self: None
t = load_target(None, "float32")
src = GreedySource(t, Path("../shared/data/train_prompts.jsonl"), capture=True)
corpus = open_corpus(root, t.model.args.vocab_size)
jobs = src.jobs()
job = next(j for j in jobs if j.name == f"shard-{first:05d}.npz")
group = [job] + src.companions(job, [j for j in jobs if j.index >= job.index])
orig = GreedyRows.step
state = {"n": 0, "t0": None, "tokens": 0}
def step(self):
    if state["t0"] is None:
        state["t0"] = time.perf_counter()
    orig(self)
    state["n"] += 1
    state["tokens"] += self.live
    if state["n"] >= N:
        dt = time.perf_counter() - state["t0"]
        print(json.dumps({"mode": mode, "steps": N, "seconds": round(dt, 1), "cpu": round(time.process_time(), 1)}), flush=True)
        raise SystemExit(0)
GreedyRows.step = step
src.make_group(group, corpus, lambda a, b: None)
