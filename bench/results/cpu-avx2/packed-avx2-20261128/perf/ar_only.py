import json
import mlx_redrafter; mlx_redrafter.install_blas()
from mlx_redrafter import api
lm = api.load()
prompts = [json.loads(l)["turns"][0] for l in open("mlx_redrafter/data/mt_bench.jsonl")][::10][:4]
api.generate(lm, prompts[0], draft="none", max_tokens=8)
for p in prompts:
    api.generate(lm, p, draft="none", max_tokens=128)
