import sys, collections
sys.path.insert(0, ".")
from mlx_redrafter import install_blas; install_blas()
from mlx_redrafter import api
from mlx_redrafter.options import DecodeOptions
from mlx_redrafter.prompts import first_turns
lm = api.load(None, dtype="float32")
rows = first_turns(); prompts = [rows[i]["prompt"] for i in range(0, 80, 5)]
h = collections.Counter(); acc = collections.defaultdict(int)
for p in prompts:
    ids = api.encode_prompt(lm, p)
    for r in api.decode(lm, ids, DecodeOptions(draft="auto", max_tokens=128)):
        if getattr(r, "verified", None):
            h[r.verified] += 1; acc[r.verified] += r.accepted + 1
print(sorted(h.items())); print({k: round(acc[k]/h[k], 2) for k in sorted(h)})
