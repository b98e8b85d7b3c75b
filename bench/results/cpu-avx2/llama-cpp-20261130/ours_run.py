import sys, json, time
sys.path.insert(0, ".")
from mlx_redrafter import install_blas; install_blas()
from mlx_redrafter import api
from mlx_redrafter.options import DecodeOptions
from mlx_redrafter.sweep import decode
P = json.load(open(sys.argv[1])); out = sys.argv[2]
lm = api.load(None, dtype="float32")
cfgs = {"ar": DecodeOptions(draft="none", max_tokens=128), "default": DecodeOptions(draft="auto", max_tokens=128)}
res = {c: {} for c in cfgs}
for s in ("mtbench", "heldout"):
    for c in cfgs: res[c][s] = []
    for j, ids in enumerate(P[s]):
        for c in (list(cfgs) if j % 2 == 0 else list(cfgs)[::-1]):
            toks, st = decode(lm, ids, cfgs[c])
            res[c][s].append({"tokens": toks, "prefill_s": st.prefill_s, "decode_s": st.decode_s})
    for c in cfgs:
        d = sum(r["decode_s"] for r in res[c][s]); n = sum(len(r["tokens"]) - 1 for r in res[c][s])
        print(s, c, f"decode {d:.2f} s, {n} tokens, {n / d:.1f} tok/s", flush=True)
json.dump(res, open(out, "w"))
