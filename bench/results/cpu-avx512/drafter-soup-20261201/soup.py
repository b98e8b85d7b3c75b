"""Weight soups of the shipped drafter and run 10's (both grown from round 7): replayed tokens per call, drafter
alone W1 L4, on the held-out prompts (choice) and MT-bench 80 (report)."""
import json
import sys
import time
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

SHIPPED = Path("mlx_redrafter/drafters/smollm2-135m")
OTHERS = {"run10": Path("runs/cuda/cuda-job-20261130-run10/soft-fuse3-wide"), "ftself": Path("runs/cpu-ft-self1/drafter")}
out = Path(sys.argv[1])
alphas = [float(a) for a in sys.argv[2].split(",")]
other = sys.argv[3] if len(sys.argv) > 3 else "run10"
a = load_file(str(SHIPPED / "model.safetensors"))
b = load_file(str(OTHERS[other] / "model.safetensors"))
cfg = json.loads((OTHERS[other] / "config.json").read_text())
dirs = {}
for al in alphas:
    d = out / f"{other}-a{al:g}"
    d.mkdir(parents=True, exist_ok=True)
    w = {}
    for k, y in b.items():
        if k == "draft_vocab":
            w[k] = y
            continue
        x = a[k].astype(np.float32)
        y32 = y.astype(np.float32)
        if x.shape != y.shape:  # the wide head: its first rows are the shipped one's, the rest run 10's own
            x = np.concatenate([x, y32[x.shape[0]:]])
        w[k] = ((1 - al) * x + al * y32).astype(y.dtype)
    save_file(w, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps(cfg))
    dirs[al] = d

target = load_target(None, "float32")
sets = {"held": heldout_prompt_ids(Path("data/corpus/smollm2-135m"), 48),
        "self": heldout_prompt_ids(Path("data/corpus/smollm2-135m-self"), 48)}
rows = []
vocabs = [8192, 12288, 16384] if cfg.get("draft_vocab_size", 0) > 8192 else [8192]
for al, d in dirs.items():
    drafter, name = api.resolve_drafter(str(d), target)
    lm = api.LoadedModel(target=target, drafter=drafter, drafter_name=name)
    for where, ids in [*sets.items(), ("mt", [api.encode_prompt(lm, r["prompt"]) for r in first_turns(None, 80)])]:
        answers = greedy_answers(lm, ids, 128, None, ".cache/replay")
        for V in vocabs:
            opts = api.decode_options(draft="rnn", beam_width=1, beam_length=4, max_tokens=128, drafter_vocab=V)
            t0 = time.perf_counter()
            st = replay_answers(answers, partial(api.make_allocator, lm, opts), 4, 128)
            steps, dec = sum(s.steps for s in st), sum(s.decided for s in st)
            rows.append({"other": other, "alpha": al, "vocab": V, "set": where, "calls": steps, "decided": dec,
                         "tokens_per_call": round(dec / steps, 4)})
            print(json.dumps(rows[-1]), f"{time.perf_counter() - t0:.0f}s", flush=True)
(out / f"soup-{other}.json").write_text(json.dumps(rows, indent=1))
