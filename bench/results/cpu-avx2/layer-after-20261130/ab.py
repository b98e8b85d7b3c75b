"""Decoding with each layer's attention, output product and MLP as one node (`packed_linear.layer_after`) and as
the separate nodes, in one process: plain (AR) and the default mode, 128 tokens, greedy, every 10th MT-bench
first turn and the corpus' held-out prompts; the two variants alternate per prompt and round.
Usage (repository root): ab.py ROUNDS [PROMPTS_PER_SET]"""
import sys, time
sys.path.insert(0, ".")
from mlx_redrafter import install_blas; install_blas()
from mlx_redrafter import api
from mlx_redrafter.options import DecodeOptions
from mlx_redrafter.sweep import decode
from mlx_redrafter.prompts import first_turns
from mlx_redrafter.train.evaluate import heldout_prompt_ids
rounds = int(sys.argv[1]); per = int(sys.argv[2]) if len(sys.argv) > 2 else 8
lm = api.load(None, dtype="float32")
layers = lm.target.model.compiled
rows = first_turns()
ids = [api.encode_prompt(lm, rows[i]["prompt"]) for i in range(0, 80, 80 // per)][:per]
ids += heldout_prompt_ids("data/corpus/smollm2-135m", per)
for fuse in (False, True):
    layers.fuse = fuse
    decode(lm, ids[0], DecodeOptions(draft="auto", max_tokens=16))
T, toks, calls = {}, {}, {}
for rnd in range(rounds):
    for i, x in enumerate(ids):
        for draft in ("auto", "none"):
            for fuse in ((False, True) if (i + rnd) % 2 == 0 else (True, False)):
                layers.fuse = fuse
                out, st = decode(lm, x, DecodeOptions(draft=draft, max_tokens=128))
                key = (draft, fuse)
                T[key] = T.get(key, 0) + st.decode_s
                calls[key] = calls.get(key, 0) + st.steps
                toks.setdefault(key, []).append(tuple(out))
    print("round", rnd, {f"{d}-{'fused' if f else 'separate'}": round(v, 2) for (d, f), v in T.items()}, flush=True)
for draft in ("none", "auto"):
    a, b = T[(draft, False)], T[(draft, True)]
    n = sum(len(t) - 1 for t in toks[(draft, True)])
    print(f"{draft}: separate {a:.2f} s, fused {b:.2f} s: {a / b:.3f}x; {n / b:.1f} vs {n / a:.1f} tokens/s; "
          f"same ids: {toks[(draft, False)] == toks[(draft, True)]}")
print(f"default over AR: separate {T[('none', False)] / T[('auto', False)]:.3f}x, "
      f"fused {T[('none', True)] / T[('auto', True)]:.3f}x")
print("identical across modes:", toks[("none", True)] == toks[("auto", True)])
