import sys, time, json, os
sys.path.insert(0, ".")
from mlx_redrafter import install_blas; install_blas()
from collections import Counter
from mlx_redrafter import api
from mlx_redrafter.options import DecodeOptions
from mlx_redrafter.sweep import decode
from mlx_redrafter.prompts import first_turns
lm = api.load(None, dtype="float32")
rows = first_turns(); prompts = [rows[i]["prompt"] for i in range(0, 80, 10)]
ids = [api.encode_prompt(lm, p) for p in prompts]
res = {}
for rep in range(2):
    for draft, prof in (("none", False), ("auto", False), ("auto", True)):
        ph = Counter(); steps = toks = 0; dec = 0.0
        for x in ids:
            out, st = decode(lm, x, DecodeOptions(draft=draft, max_tokens=128), profile=prof)
            ph.update(st.phase_s); steps += st.steps; toks += len(out); dec += st.decode_s
        key = draft + ("-prof" if prof else "")
        r = res.setdefault(key, {"decode_s": [], "tpc": round(toks / max(steps, 1), 3), "steps": steps, "toks": toks})
        r["decode_s"].append(round(dec, 2))
        if prof: r["phase_ms_per_step"] = {k: round(1e3 * v / steps, 2) for k, v in ph.items()}
print(os.environ.get("MKL_NUM_THREADS"), json.dumps(res, indent=1))
