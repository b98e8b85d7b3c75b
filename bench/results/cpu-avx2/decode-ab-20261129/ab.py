"""One run: decode 8 MT-bench first turns, each followed by "Answer with a JSON object.", 128 tokens, greedy fp32,
with one draft mode, with or without the answer constrained to any JSON object; prints the pooled decode time,
tokens, tokens per call and a hash of the ids. Run with PYTHONPATH pointing at the code under test:

    PYTHONPATH=/path/to/checkout MKL_NUM_THREADS=2 .venv/bin/python ab.py none|auto json|free
"""

import hashlib
import json
import sys

from mlx_redrafter import install_blas


def main() -> None:
    install_blas()  # before anything imports mlx.core
    from mlx_redrafter import api
    from mlx_redrafter.prompts import first_turns

    draft, constrained = sys.argv[1], sys.argv[2] == "json"
    options = {"json_schema": {"type": "object"}} if constrained else {}
    prompts = [r["prompt"] + "\n\nAnswer with a JSON object." for r in first_turns()][:80:10]
    lm = api.load(drafter="default" if draft != "none" else "none")
    api.generate(lm, "Warm up.", max_tokens=16, draft=draft, **options)
    seconds, tokens, steps, ids, parsed = 0.0, 0, 0, [], 0
    for p in prompts:
        r = api.generate(lm, p, max_tokens=128, draft=draft, **options)
        seconds += r.stats.decode_s
        tokens += r.stats.generated_tokens - 1
        steps += r.stats.steps
        ids.append(r.tokens)
        try:
            parsed += isinstance(json.loads(r.text), dict)
        except ValueError:
            pass
    print(json.dumps({"draft": draft, "json": constrained, "decode_s": round(seconds, 3), "tokens": tokens,
                      "tokens_per_call": round(tokens / steps, 3), "parsed_json_objects": parsed,
                      "ids_sha256": hashlib.sha256(str(ids).encode()).hexdigest()[:16]}))


if __name__ == "__main__":
    main()
