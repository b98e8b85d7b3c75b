import sys; sys.path.insert(0, ".")
from mlx_redrafter import install_blas; install_blas()
import time
from mlx_redrafter import api
from mlx_redrafter.prompts import first_turns
from bench.agreement import compare
lm = api.load(None, dtype="quantized")
print(lm.target.model.dtype)
tot = {"none": 0.0, "auto": 0.0}
for r in first_turns()[:6]:
    ids = lm.tokenizer.encode_chat([{"role": "user", "content": r["prompt"]}]) if hasattr(lm, "tokenizer") else lm.target.tokenizer.encode_chat([{"role": "user", "content": r["prompt"]}])
    out = {}
    for d in ("none", "auto"):
        t = time.perf_counter(); res = api.generate(lm, ids, max_tokens=32, draft=d); tot[d] += time.perf_counter() - t
        out[d] = res
    a = compare(lm.target.model, ids, out["none"].tokens, out["auto"].tokens)
    print(len(out["none"].tokens), out["auto"].stats.tokens_per_step if hasattr(out["auto"].stats, "tokens_per_step") else "", a.problem())
print(tot)
