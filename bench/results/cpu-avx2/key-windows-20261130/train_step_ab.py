"""A drafter training step (the shipped drafter, 1,024 contexts x T = 5, soft labels, AdamW) on random features,
one thread: old|new (without / with system.memory.reuse_freed_memory) [STEPS]. Run two side by side."""
import sys, time
from functools import partial
from mlx_redrafter import install_blas
install_blas()
import mlx.core as mx, mlx.nn as nn, mlx.optimizers as optim, numpy as np
from mlx_redrafter.system.blas import set_threads
from mlx_redrafter.draft.kinds import load_any_drafter
from mlx_redrafter.train.loss import teacher_forced_logits, soft_loss
from mlx_redrafter.train.data import Batch
set_threads(1)
if sys.argv[1] == "new":
    from mlx_redrafter.system.memory import reuse_freed_memory
    print("reuse", reuse_freed_memory())
d = load_any_drafter("mlx_redrafter/drafters/smollm2-135m")
B, T, K, H = 1024, 5, 8, 576
F = H * (1 + len(d.args.feature_layers or ()))
rng = np.random.default_rng(0)
h = mx.array(rng.standard_normal((B, F)).astype(np.float32))
emb = mx.array(rng.standard_normal((B, T, H)).astype(np.float32) * 0.05)
tgt = mx.array(rng.integers(0, 8192, (B, T)).astype(np.int32))
w = mx.ones((B, T)); v = mx.ones((B, T))
si = mx.array(rng.integers(0, 8192, (B, T, K)).astype(np.int32)); sp = mx.full((B, T, K), 1 / K)
opt = optim.AdamW(learning_rate=1e-5)
def loss_fn(model, h, emb, tgt, w, v, si, sp):
    return soft_loss(teacher_forced_logits(model, h, emb), Batch(h, emb, tgt, w, v, si, sp))
lg = nn.value_and_grad(d, loss_fn)
state = [d.state, opt.state]
@partial(mx.compile, inputs=state, outputs=state)
def step(h, emb, tgt, w, v, si, sp):
    loss, grads = lg(d, h, emb, tgt, w, v, si, sp)
    opt.update(d, grads)
    return loss
ts = []
for i in range(int(sys.argv[2]) if len(sys.argv) > 2 else 10):
    t0 = time.perf_counter(); l = step(h, emb, tgt, w, v, si, sp); mx.eval(l, state); ts.append(time.perf_counter() - t0)
print(sys.argv[1], "median s/step (last 7):", round(float(np.median(ts[3:])), 3), [round(x, 2) for x in ts])
