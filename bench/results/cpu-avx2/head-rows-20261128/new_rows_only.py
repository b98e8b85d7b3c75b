"""One-off experiment: train only the rows --head-rows adds (the drafter's own rows and everything else frozen)."""
import sys

import mlx_redrafter

mlx_redrafter.install_blas()
import mlx.core as mx  # noqa: E402
import mlx.optimizers as optim  # noqa: E402

import mlx_redrafter.train.loop as L  # noqa: E402

OLD = 8192
orig = optim.clip_grad_norm


def masked(grads, max_norm):
    head = grads["lm_head"][-1]
    w = head["weight"]
    head["weight"] = w * (mx.arange(w.shape[0]) >= OLD)[:, None].astype(w.dtype)
    if "bias" in head:
        head["bias"] = head["bias"] * (mx.arange(w.shape[0]) >= OLD).astype(w.dtype)
    return orig(grads, max_norm)


L.optim.clip_grad_norm = masked
from mlx_redrafter.cmd.app import app  # noqa: E402

sys.exit(app())
