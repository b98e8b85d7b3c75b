"""One dtype's decoding time on MT-bench first turns (plain and the default mode), one process per call:
python speed.py DTYPE N_PROMPTS MAX_TOKENS -> one JSON line (seconds, tokens, peak RSS)."""
import json
import resource
import sys
import time

sys.path.insert(0, ".")
from mlx_redrafter import install_blas  # noqa: E402

install_blas()
from mlx_redrafter import api  # noqa: E402
from mlx_redrafter.prompts import first_turns  # noqa: E402

dtype, n, max_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
t = time.perf_counter()
lm = api.load(None, dtype=dtype)
out = {"dtype": dtype, "load_s": time.perf_counter() - t}
prompts = [r["prompt"] for r in first_turns()][:n]
tokens = {}
for draft in ("none", "auto"):
    t, toks = time.perf_counter(), []
    for p in prompts:
        toks.append(api.generate(lm, p, max_tokens=max_tokens, draft=draft).tokens)
    out[f"{draft}_s"] = time.perf_counter() - t
    tokens[draft] = toks
out["tokens"] = sum(len(x) for x in tokens["none"])
out["auto_equals_none"] = tokens["auto"] == tokens["none"]
out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps(out))
