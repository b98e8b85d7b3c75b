"""The shipped drafter (round 7) vs run 10's (its head grown to 16,384 rows and trained on an H200), in one process:
plain (AR), the default mode and the drafter alone at the default shape, 128 tokens, greedy, float32 target, every
10th MT-bench first turn and the corpus' held-out prompts; the drafters (run 10's drafting from 8,192 or 12,288 of its
rows) alternate per prompt and round.
Usage (repository root): ab.py ROUNDS [PROMPTS_PER_SET] [DRAFTER_DIR]"""
import dataclasses
import sys
sys.path.insert(0, ".")
from mlx_redrafter import install_blas; install_blas()
from mlx_redrafter import api
from mlx_redrafter.options import DecodeOptions, DrafterOptions
from mlx_redrafter.prompts import first_turns
from mlx_redrafter.sweep import decode
from mlx_redrafter.train.evaluate import heldout_prompt_ids

rounds = int(sys.argv[1]); per = int(sys.argv[2]) if len(sys.argv) > 2 else 8
new_dir = sys.argv[3] if len(sys.argv) > 3 else "runs/cuda/cuda-job-20261130-run10/soft-fuse3-wide"
lm = api.load(None, dtype="float32")
new, _ = api.resolve_drafter(new_dir, lm.target)
configs = {"shipped": (lm, None), "new-8192": (dataclasses.replace(lm, drafter=new), 8192),
           "new-12288": (dataclasses.replace(lm, drafter=new), 12288)}
rows = first_turns()
ids = [api.encode_prompt(lm, rows[i]["prompt"]) for i in range(0, 80, 80 // per)][:per]
ids += heldout_prompt_ids("data/corpus/smollm2-135m", per)
names = list(configs)


def options(draft: str, vocab: int | None) -> DecodeOptions:
    return DecodeOptions(draft=draft, max_tokens=128, drafter=DrafterOptions(vocab=vocab))


for name in names:
    m, v = configs[name]
    decode(m, ids[0], options("auto", v))
T, N, S, out_of = {}, {}, {}, {}
for rnd in range(rounds):
    for i, x in enumerate(ids):
        out, st = decode(lm, x, DecodeOptions(draft="none", max_tokens=128))
        T["ar"] = T.get("ar", 0) + st.decode_s
        N["ar"] = N.get("ar", 0) + len(out) - 1
        S["ar"] = S.get("ar", 0) + st.steps
        out_of.setdefault("ar", []).append(out)
        order = names[(i + rnd) % 3:] + names[:(i + rnd) % 3]
        for name in order:
            m, v = configs[name]
            for draft in ("auto", "rnn"):
                out, st = decode(m, x, options(draft, v))
                k = (name, draft)
                T[k] = T.get(k, 0) + st.decode_s
                N[k] = N.get(k, 0) + len(out) - 1
                S[k] = S.get(k, 0) + st.steps
                out_of.setdefault(k, []).append(out)
    print("round", rnd, "done", flush=True)
for k in T:
    print(k, f"{N[k] / T[k]:.1f} tok/s, {N[k] / S[k]:.3f} tok/call, {T['ar'] / T[k]:.3f}x AR (pooled)")
for draft in ("auto", "rnn"):
    for name in names[1:]:
        print(f"{draft}: {name} over shipped {T[('shipped', draft)] / T[(name, draft)]:.3f}x")
print("every output identical to AR:", all(out_of[k] == out_of["ar"] for k in out_of))
