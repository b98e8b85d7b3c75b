"""The drafter drafting from its 8-bit copies (int8, the default) vs its float16 copies, in one process: plain (AR),
the default mode and the drafter alone, 128 tokens, greedy, float32 target, every 10th MT-bench first turn and the
corpus' held-out prompts; the two kinds alternate per prompt and round. ISA: the packed kernel's variant (best or
avx2).
Usage (repository root): ab.py ROUNDS [PROMPTS_PER_SET] [ISA]"""
import sys
sys.path.insert(0, ".")
from mlx_redrafter import install_blas; install_blas()
from mlx_redrafter import api
from mlx_redrafter.draft.weight_copies import use_weight_copies
from mlx_redrafter.options import DecodeOptions
from mlx_redrafter.prompts import first_turns
from mlx_redrafter.sweep import decode
from mlx_redrafter.system import packed_linear
from mlx_redrafter.train.evaluate import heldout_prompt_ids

rounds = int(sys.argv[1]); per = int(sys.argv[2]) if len(sys.argv) > 2 else 8
isa = sys.argv[3] if len(sys.argv) > 3 else "best"
lm = api.load(None, dtype="float32")
rows = first_turns()
ids = [api.encode_prompt(lm, rows[i]["prompt"]) for i in range(0, 80, 80 // per)][:per]
ids += heldout_prompt_ids("data/corpus/smollm2-135m", per)
kinds = ("float16", "int8")
with packed_linear.KERNEL.use_isa(isa) as used:
    print("packed kernel variant:", used)
    for kind in kinds:
        use_weight_copies(lm.drafter, kind)
        decode(lm, ids[0], DecodeOptions(draft="auto", max_tokens=16))
    T, N, S, D, out_of = {}, {}, {}, {}, {}
    for rnd in range(rounds):
        for i, x in enumerate(ids):
            out, st = decode(lm, x, DecodeOptions(draft="none", max_tokens=128))
            T["ar"] = T.get("ar", 0) + st.decode_s
            N["ar"] = N.get("ar", 0) + len(out) - 1
            S["ar"] = S.get("ar", 0) + st.steps
            out_of.setdefault("ar", []).append(out)
            for kind in (kinds if (i + rnd) % 2 == 0 else kinds[::-1]):
                use_weight_copies(lm.drafter, kind)
                for draft in ("auto", "rnn"):
                    out, st = decode(lm, x, DecodeOptions(draft=draft, max_tokens=128))
                    k = (kind, draft)
                    T[k] = T.get(k, 0) + st.decode_s
                    N[k] = N.get(k, 0) + len(out) - 1
                    S[k] = S.get(k, 0) + st.steps
                    D[k] = D.get(k, 0) + st.phase_s.get("draft", 0)
                    out_of.setdefault(k, []).append(out)
        print("round", rnd, "done", flush=True)
for k in T:
    print(k, f"{N[k] / T[k]:.1f} tok/s, {N[k] / S[k]:.3f} tok/call, {T['ar'] / T[k]:.3f}x AR (pooled), "
          f"draft+pack {1e3 * D.get(k, 0) / S[k]:.2f} ms/step")
for draft in ("auto", "rnn"):
    print(f"{draft}: int8 over float16 {T[('float16', draft)] / T[('int8', draft)]:.3f}x")
print("every output identical to AR:", all(out_of[k] == out_of["ar"] for k in out_of))
