"""A model kept quantized (`dtype="quantized"`), the default mode: its products read the packed weights up to 6 rows
(before) or up to 64 rows (`packed_linear.KEPT_QUANTIZED_MAX_ROWS`), switched per prompt in one process, alternating
which goes first. 8 spread MT-bench first turns plain and each followed by "Answer with a JSON object." (longer
lookup copies), 128 tokens, decode time."""
import json
import sys

from mlx_redrafter import install_blas

install_blas()
from mlx_redrafter import api  # noqa: E402
from mlx_redrafter.prompts import first_turns  # noqa: E402
from mlx_redrafter.system import packed_linear  # noqa: E402

isa = packed_linear.KERNEL.isa
turns = [r["prompt"] for r in first_turns()][:80:10]
prompts = turns + [p + "\n\nAnswer with a JSON object." for p in turns]
lm = api.load(dtype="quantized")
api.generate(lm, "Warm up.", max_tokens=16)
tot = {6: 0.0, 64: 0.0}
ids = {6: [], 64: []}
steps = 0
for rep in range(int(sys.argv[1]) if len(sys.argv) > 1 else 1):
    for i, p in enumerate(prompts):
        for limit in (6, 64) if (i + rep) % 2 else (64, 6):
            packed_linear.KEPT_QUANTIZED_MAX_ROWS[isa] = limit
            r = api.generate(lm, p, max_tokens=128)
            tot[limit] += r.stats.decode_s
            ids[limit].append(r.tokens)
            steps += r.stats.steps if limit == 64 else 0
tokens = sum(len(t) for t in ids[64])
print(json.dumps({"rows_6_s": round(tot[6], 2), "rows_64_s": round(tot[64], 2), "speedup": round(tot[6] / tot[64], 3),
                  "tokens": tokens, "tokens_per_call": round(tokens / steps, 3), "same_ids": ids[6] == ids[64]}))
