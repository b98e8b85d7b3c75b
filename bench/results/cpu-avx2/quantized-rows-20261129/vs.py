"""The embedded model kept quantized vs float32, one process, alternating per prompt and mode (which goes first
alternates too): 8 spread MT-bench first turns x 64 tokens, plain and the default mode; decode time pooled."""
import json
from mlx_redrafter import install_blas
install_blas()
from mlx_redrafter import api  # noqa: E402
from mlx_redrafter.prompts import first_turns  # noqa: E402

lms = {d: api.load(None, dtype=d) for d in ("float32", "quantized")}
for lm in lms.values():
    api.generate(lm, "Warm up.", max_tokens=8)
prompts = [r["prompt"] for r in first_turns()][:80:10]
tot = {(d, m): 0.0 for d in lms for m in ("none", "auto")}
ids = {k: [] for k in tot}
k = 0
for p in prompts:
    for mode in ("none", "auto"):
        order = ("float32", "quantized") if k % 2 else ("quantized", "float32")
        k += 1
        for d in order:
            r = api.generate(lms[d], p, max_tokens=64, draft=mode)
            tot[(d, mode)] += r.stats.decode_s
            ids[(d, mode)].append(r.tokens)
out = {f"{d}_{m}_s": round(v, 2) for (d, m), v in tot.items()}
q = tot[("quantized", "none")] + tot[("quantized", "auto")]
f = tot[("float32", "none")] + tot[("float32", "auto")]
out.update(quantized_over_float32=round(q / f, 3), same_ids=len({str(v) for v in ids.values()}) == 1)
print(json.dumps(out))
