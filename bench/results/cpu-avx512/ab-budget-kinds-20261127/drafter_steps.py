import json, sys, numpy as np
import mlx_redrafter; mlx_redrafter.install_blas()
from mlx_redrafter import api
from mlx_redrafter.draft.redrafter import RnnSource
from mlx_redrafter.prompts import first_turns
from mlx_redrafter.train.evaluate import heldout_prompt_ids
lm = api.load(None, "default", "float32")
log = []
orig = RnnSource.propose
def rec(self, state, length, width):
    c = orig(self, state, length, width)
    log.append((len(state.tokens), None if c is None else np.array(c).tolist()))
    return c
RnnSource.propose = rec
out = {}
sets = {"mt": [api.encode_prompt(lm, r["prompt"]) for r in first_turns(None, 80)],
        "heldout": heldout_prompt_ids("data/corpus/smollm2-135m", 80)}
for name, prompts in sets.items():
    res = []
    for p in prompts:
        log.clear()
        r = api.generate(lm, p, api.decode_options(draft="rnn", beam_width=1, beam_length=4, max_tokens=128))
        res.append({"prompt": p, "answer": r.tokens if hasattr(r, "tokens") else r.ids, "steps": list(log)})
    out[name] = res
    print(name, len(res), flush=True)
json.dump(out, open("/tmp/kb/rnnsteps.json", "w"))
