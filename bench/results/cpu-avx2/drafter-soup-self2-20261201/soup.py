"""Drafters mixed from the shipped round 8 (S): S + sum_i c_i * (D_i - S) per tensor, D_i among round 7 ("r7", the
weights before round 8; a negative coefficient moves past round 8 along the line from round 7) and the fine-tune of
round 8 on the second self-prompted corpus ("ft2"). Each mix is replayed (`train/replay.py`): tokens per call of
the drafter alone (W1 L4, 128 tokens, float32, pooled, the runtime's 8,192 head rows) on four prompt sets: the
shared pool's and the first self-prompted corpus' held-out first turns ("held", "self": the choice), the second
self-prompted corpus' held-out first turns ("self2") and MT-bench's 80 first turns ("mt"): reported, not chosen on.
Usage: soup.py OUT_DIR "r7=-0.2" "ft2=0.3" "r7=-0.2,ft2=0.3" ... ("" is S itself)."""
import json
import sys
from functools import partial
from pathlib import Path

import mlx_redrafter

mlx_redrafter.install_blas()
import numpy as np  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402

from mlx_redrafter import api  # noqa: E402
from mlx_redrafter.models.loader import load_target  # noqa: E402
from mlx_redrafter.prompts import first_turns  # noqa: E402
from mlx_redrafter.train.evaluate import heldout_prompt_ids  # noqa: E402
from mlx_redrafter.train.replay import greedy_answers, replay_answers  # noqa: E402

out = Path(sys.argv[1])
shipped = Path("mlx_redrafter/drafters/smollm2-135m")
S = load_file(str(shipped / "model.safetensors"))
ENDS = {"r7": "/tmp/r7.safetensors",  # git show 70d7919:mlx_redrafter/drafters/smollm2-135m/model.safetensors
        "ft2": "runs/cpu-ft-self2/drafter/model.safetensors"}
cfg = (shipped / "config.json").read_text()

target = load_target(None, "float32")
sets = {"held": heldout_prompt_ids(Path("data/corpus/smollm2-135m"), 48),
        "self": heldout_prompt_ids(Path("data/corpus/smollm2-135m-self"), 48),
        "self2": heldout_prompt_ids(Path("data/corpus/smollm2-135m-self2"), 48)}
rows = json.loads((out / "soup.json").read_text()) if (out / "soup.json").exists() else []
for spec in sys.argv[2:]:
    coefs = {k: float(v) for k, v in (p.split("=") for p in spec.split(",") if p)}
    ends = {k: load_file(ENDS[k]) for k in coefs}
    w = {}
    for k, y in S.items():
        if k == "draft_vocab":
            w[k] = y
            continue
        base = y.astype(np.float32)
        w[k] = (base + sum(c * (ends[n][k].astype(np.float32) - base) for n, c in coefs.items())).astype(y.dtype)
    d = out / ("mix-" + (spec.replace("=", "").replace(",", "_") or "S"))
    d.mkdir(parents=True, exist_ok=True)
    save_file(w, str(d / "model.safetensors"))
    (d / "config.json").write_text(cfg)
    drafter, name = api.resolve_drafter(str(d), target)
    lm = api.LoadedModel(target=target, drafter=drafter, drafter_name=name)
    for where, ids in [*sets.items(), ("mt", [api.encode_prompt(lm, r["prompt"]) for r in first_turns(None, 80)])]:
        answers = greedy_answers(lm, ids, 128, print, ".cache/replay")
        opts = api.decode_options(draft="rnn", beam_width=1, beam_length=4, max_tokens=128, drafter_vocab=8192)
        st = replay_answers(answers, partial(api.make_allocator, lm, opts), 4, 128)
        steps, dec = sum(s.steps for s in st), sum(s.decided for s in st)
        rows.append({"mix": spec or "S", "set": where, "calls": steps, "decided": dec,
                     "tokens_per_call": round(dec / steps, 4)})
        print(json.dumps(rows[-1]), flush=True)
    (out / "soup.json").write_text(json.dumps(rows, indent=1))
