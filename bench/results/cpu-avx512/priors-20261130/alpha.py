import sys, os
sys.path.insert(0, ".")
os.environ["REDRAFTER_STEP_COSTS"] = "curve"
from mlx_redrafter import install_blas; install_blas()
from mlx_redrafter import api
from mlx_redrafter.batch import budget as B
from mlx_redrafter.prompts import first_turns
from mlx_redrafter.train.evaluate import heldout_prompt_ids
made = []
orig = B.Budget.__init__
def init(self, *a, **k):
    orig(self, *a, **k); made.append(self)
B.Budget.__init__ = init
lm = api.load(None, dtype="float32")
rows = first_turns()
ids = [api.encode_prompt(lm, rows[i]["prompt"]) for i in range(0, 80, 5)][:16]
ids += heldout_prompt_ids("data/corpus/smollm2-135m", 16)
curve = B.CostCurve({b: [0.03 * b * (1 + 0.1 * p) for p in range(12)] for b in range(1, 9)}, context=128)
for _ in api.stream_batch(lm, ids, batch_size=4, curve=curve, max_tokens=128, chat=False):
    pass
print({k: round(v, 3) for k, v in sorted(made[-1].alpha.items())})
