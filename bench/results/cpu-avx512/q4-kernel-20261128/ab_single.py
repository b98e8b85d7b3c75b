import sys, time, json
import mlx_redrafter; mlx_redrafter.install_blas()
import mlx.core as mx
from mlx_redrafter import api
from mlx_redrafter.prompts import first_turns
from mlx_redrafter.system import packed_linear
print("kernel from", packed_linear.__file__, packed_linear.VERSION, flush=True)
lm = api.load(None, "default", "float32")
prompts = [api.encode_prompt(lm, r["prompt"]) for r in first_turns(None, 16, spread=True)]
cfgs = {"ar": dict(draft="none"), "default": dict(), "rnn-L4": dict(draft="rnn", beam_width=1, beam_length=4),
        "default-L3": dict(beam_length=3)}
opts = {k: api.decode_options(max_tokens=128, **v) for k, v in cfgs.items()}
for o in opts.values():
    list(api.decode(lm, prompts[0][:20], api.decode_options(max_tokens=16, **{})))
out = {}
for name, o in opts.items():
    list(api.decode(lm, prompts[0], api.decode_options(max_tokens=16)))
    t = time.perf_counter(); n = calls = 0; ids = []
    for p in prompts:
        toks = []
        for r in api.decode(lm, p, o):
            toks += r.tokens; calls += (r.prefill == 0)
        n += len(toks); ids.append(toks)
    dt = time.perf_counter() - t
    out[name] = dict(tokens=n, seconds=dt, calls=calls, ids=ids)
    print(f"{name:10s} {n/dt:6.1f} tok/s  {n/calls:.3f} t/c  {dt:.1f}s", flush=True)
json.dump(out, open(sys.argv[1], "w"))
