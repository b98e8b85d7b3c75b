"""Default mode at beam lengths 3/4/5 (or argv[2], e.g. 2,3,4, or with a draft confidence cut L:P, e.g. 3,4:0.15) vs plain decoding: 16 MT-bench first turns (every 5th) + 16 held-out corpus
prompts, 128 tokens, greedy float32, decode time, interleaved per prompt with rotating order."""
import sys, json, time, os
sys.path.insert(0, ".")
from mlx_redrafter import install_blas; install_blas()
from mlx_redrafter import api
from mlx_redrafter.options import DecodeOptions
from mlx_redrafter.sweep import decode
from mlx_redrafter.prompts import first_turns
from mlx_redrafter.train.evaluate import heldout_prompt_ids
lm = api.load(None, dtype="float32")
rows = first_turns()
sets = {"mtbench": [api.encode_prompt(lm, rows[i]["prompt"]) for i in range(0, 80, 5)],
        "heldout": heldout_prompt_ids("data/corpus/smollm2-135m", 16)}
cfgs = {"ar": DecodeOptions(draft="none", max_tokens=128)}
for item in (sys.argv[2].split(",") if len(sys.argv) > 2 else ("3", "4", "5")):
    L, _, P = item.partition(":")
    o = DecodeOptions(draft="auto", max_tokens=128).updated(beam_length=int(L), draft_confidence=float(P or 0))
    cfgs[f"L{L}" + (f"c{P}" if P else "")] = o
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 1
res = {s: {c: {"s": 0.0, "toks": 0, "steps": 0} for c in cfgs} for s in sets}
ref = {}
names = list(cfgs)
for r in range(rounds):
    for s, idss in sets.items():
        for j, ids in enumerate(idss):
            order = names[(j + r) % len(names):] + names[:(j + r) % len(names)]
            for c in order:
                out, st = decode(lm, ids, cfgs[c])
                key = (s, j)
                if key in ref: assert ref[key] == out, (s, j, c)
                else: ref[key] = out
                x = res[s][c]; x["s"] += st.decode_s; x["toks"] += len(out); x["steps"] += st.steps
    print(f"round {r + 1} done {time.strftime('%H:%M:%S')}", file=sys.stderr, flush=True)
for s in sets:
    ar = res[s]["ar"]["s"]
    print(s, {c: {"decode_s": round(v["s"], 2), "tpc": round(v["toks"] / max(v["steps"], 1), 3),
                  "vs_ar": round(ar / v["s"], 3)} for c, v in res[s].items()})
tot = {c: sum(res[s][c]["s"] for s in sets) for c in cfgs}
print("pooled vs ar", {c: round(tot["ar"] / t, 3) for c, t in tot.items()})
