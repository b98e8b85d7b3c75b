"""llama.cpp (llama-cpp-python) greedy decoding of the same prompts, the same GGUF: decode time of 128 tokens.
argv: prompts.json gguf out.json [mode: plain|lookup] [threads]"""
import sys, json, time
import llama_cpp
from llama_cpp import Llama
P = json.load(open(sys.argv[1])); gguf = sys.argv[2]; out = sys.argv[3]
mode = sys.argv[4] if len(sys.argv) > 4 else "plain"
threads = int(sys.argv[5]) if len(sys.argv) > 5 else 2
kw = {}
if mode == "lookup":
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    kw["draft_model"] = LlamaPromptLookupDecoding(num_pred_tokens=int(sys.argv[6]) if len(sys.argv) > 6 else 10)
llm = Llama(model_path=gguf, n_ctx=1024, n_threads=threads, n_threads_batch=threads, n_batch=512, verbose=False,
            seed=0, **kw)
eos = set(P["eos"])
res = {}
for s in ("mtbench", "heldout"):
    res[s] = []
    for ids in P[s]:
        toks, t_first = [], None
        t0 = time.perf_counter()
        for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            if t_first is None:
                t_first = time.perf_counter()
            if tok in eos:
                break
            toks.append(tok)
            if len(toks) >= 128:
                break
        t1 = time.perf_counter()
        res[s].append({"tokens": toks, "prefill_s": t_first - t0, "decode_s": t1 - t_first})
    d = sum(r["decode_s"] for r in res[s]); n = sum(len(r["tokens"]) - 1 for r in res[s])
    print(s, mode, f"decode {d:.2f} s, {n} tokens, {n / d:.1f} tok/s", flush=True)
json.dump(res, open(out, "w"))
