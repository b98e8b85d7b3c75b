"""Task arithmetic of three drafters grown from the shipped one: shipped + a * (run10 - shipped) + b * (ftself -
shipped), the fine-tune on the self-prompted corpus alone (drafter-self-ft-20261201) as the third; replayed
tokens per call, drafter alone W1 L4, held-out sets (choice) and MT-bench 80 (report), the runtime's 8,192 rows
and 12,288."""
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
pairs = [tuple(float(x) for x in p.split(":")) for p in sys.argv[2].split(",")]
s0 = load_file("mlx_redrafter/drafters/smollm2-135m/model.safetensors")
r10 = load_file("runs/cuda/cuda-job-20261130-run10/soft-fuse3-wide/model.safetensors")
ft = load_file("runs/cpu-ft-self1/drafter/model.safetensors")
cfg = json.loads(Path("runs/cuda/cuda-job-20261130-run10/soft-fuse3-wide/config.json").read_text())


def wide(x, like):
    x = x.astype(np.float32)
    return np.concatenate([x, like.astype(np.float32)[x.shape[0]:]]) if x.shape != like.shape else x


target = load_target(None, "float32")
sets = {"held": heldout_prompt_ids(Path("data/corpus/smollm2-135m"), 48),
        "self": heldout_prompt_ids(Path("data/corpus/smollm2-135m-self"), 48)}
rows = []
for a, b in pairs:
    d = out / f"a{a:g}-b{b:g}"
    d.mkdir(parents=True, exist_ok=True)
    w = {}
    for k, y in r10.items():
        if k == "draft_vocab":
            w[k] = y
            continue
        base = wide(s0[k], y)
        w[k] = (base + a * (y.astype(np.float32) - base) + b * (wide(ft[k], y) - base)).astype(y.dtype)
    save_file(w, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps(cfg))
    drafter, name = api.resolve_drafter(str(d), target)
    lm = api.LoadedModel(target=target, drafter=drafter, drafter_name=name)
    for where, ids in [*sets.items(), ("mt", [api.encode_prompt(lm, r["prompt"]) for r in first_turns(None, 80)])]:
        answers = greedy_answers(lm, ids, 128, None, ".cache/replay")
        for V in (8192, 12288):
            opts = api.decode_options(draft="rnn", beam_width=1, beam_length=4, max_tokens=128, drafter_vocab=V)
            st = replay_answers(answers, partial(api.make_allocator, lm, opts), 4, 128)
            steps, dec = sum(s.steps for s in st), sum(s.decided for s in st)
            rows.append({"run10": a, "ftself": b, "vocab": V, "set": where, "calls": steps, "decided": dec,
                         "tokens_per_call": round(dec / steps, 4)})
            print(json.dumps(rows[-1]), flush=True)
(out / "soup3.json").write_text(json.dumps(rows, indent=1))
