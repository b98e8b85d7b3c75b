"""One A/B run: decode 8 MT-bench first turns (128 tokens, greedy fp32) with one draft mode, optionally asking for
log-probabilities and for other decoding options (a JSON object of flat option names, e.g. penalties); prints the
pooled decode time. Run with PYTHONPATH pointing at the code under test:

    PYTHONPATH=/path/to/checkout MKL_NUM_THREADS=2 .venv/bin/python ab.py none|auto -|K ['{"repetition_penalty": 1.1}']
"""

import hashlib
import json
import sys

from mlx_redrafter import install_blas


def main() -> None:
    install_blas()  # before anything imports mlx.core
    import mlx_redrafter
    from mlx_redrafter import api
    from mlx_redrafter.prompts import first_turns

    draft, logprobs = sys.argv[1], (None if sys.argv[2] == "-" else int(sys.argv[2]))
    options = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    prompts = [r["prompt"] for r in first_turns()][:80:10]
    lm = api.load(drafter="default" if draft != "none" else "none")
    api.generate(lm, "Warm up.", max_tokens=16, draft=draft)
    seconds, tokens, ids = 0.0, 0, []
    for p in prompts:
        r = api.generate(lm, p, max_tokens=128, draft=draft, logprobs=logprobs, **options)
        seconds += r.stats.decode_s
        tokens += r.stats.generated_tokens - 1
        ids.append(r.tokens)
    print(json.dumps({"root": mlx_redrafter.__file__, "draft": draft, "logprobs": logprobs, "decode_s": seconds,
                      "tokens": tokens, "ids_sha256": hashlib.sha256(str(ids).encode()).hexdigest()[:16]}))


if __name__ == "__main__":
    main()
