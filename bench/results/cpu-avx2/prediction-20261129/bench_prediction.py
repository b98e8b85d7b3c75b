"""Predicted outputs on the embedded model: 8 MT-bench first turns, 128 new tokens, greedy fp32. Per prompt, AR's
answer is the prediction ("regenerate"), or that answer with a sentence-sized middle part replaced ("edited"), or
nothing; the default mode decodes with each (ids checked equal to AR's), AR alone as the baseline. Configurations
alternate within each round; two rounds; pooled times."""

from mlx_redrafter import install_blas

install_blas()

import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

from mlx_redrafter import api  # noqa: E402
from mlx_redrafter.prompts import first_turns  # noqa: E402

N, TOKENS, ROUNDS = 8, 128, 2
lm = api.load()
tok = lm.tokenizer
turns = first_turns()
prompts = [turns[(k * len(turns)) // N]["prompt"] for k in range(N)]
ar = [api.generate(lm, p, max_tokens=TOKENS, draft="none") for p in prompts]
edit = tok.encode(" (here the text was changed by an edit of a few words)")
predictions = {
    "none": [None] * N,
    "regenerate": [a.text for a in ar],
    "edited": [tok.decode(a.tokens[: len(a.tokens) // 2] + edit + a.tokens[len(a.tokens) // 2 + 12 :]) for a in ar],
}
times = {k: 0.0 for k in ["ar", *predictions]}
calls = {k: 0 for k in predictions}
for r in range(ROUNDS):
    for i, p in enumerate(prompts):
        t = time.perf_counter()
        got = api.generate(lm, p, max_tokens=TOKENS, draft="none")
        times["ar"] += time.perf_counter() - t
        assert got.tokens == ar[i].tokens
        for k, preds in predictions.items():
            t = time.perf_counter()
            got = api.generate(lm, p, max_tokens=TOKENS, prediction=preds[i])
            times[k] += time.perf_counter() - t
            assert got.tokens == ar[i].tokens, (k, i)
            calls[k] += got.stats.steps
tokens = ROUNDS * sum(len(a.tokens) for a in ar)
out = {"tokens": tokens, "seconds": {k: round(v, 2) for k, v in times.items()},
       "speed_vs_ar_pooled": {k: round(times["ar"] / times[k], 3) for k in predictions},
       "tokens_per_call": {k: round(tokens / calls[k], 3) for k in predictions}}
json.dump(out, sys.stdout, indent=1)
print()
