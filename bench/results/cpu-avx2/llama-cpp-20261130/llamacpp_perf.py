import sys, json, time
import llama_cpp
from llama_cpp import Llama
P = json.load(open(sys.argv[1])); gguf = sys.argv[2]
llm = Llama(model_path=gguf, n_ctx=1024, n_threads=2, n_threads_batch=2, n_batch=512, verbose=False, seed=0)
eos = set(P["eos"]); wall = 0.0; n = 0; native = 0.0; nn = 0
for ids in P["mtbench"][:8]:
    llama_cpp.llama_perf_context_reset(llm.ctx)
    t_first = None; k = 0
    for tok in llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
        if t_first is None: t_first = time.perf_counter()
        if tok in eos: break
        k += 1
        if k >= 128: break
    wall += time.perf_counter() - t_first; n += k - 1
    d = llama_cpp.llama_perf_context(llm.ctx)
    native += d.t_eval_ms; nn += d.n_eval
print(f"python loop: {wall / n * 1e3:.2f} ms/token; native eval: {native / nn:.2f} ms/token over {nn} evals")
