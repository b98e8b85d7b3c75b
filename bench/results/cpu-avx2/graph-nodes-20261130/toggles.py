"""The graph-node cuts switched off and on in one process (for the A/B scripts here): `switch(model, new)` puts
MLX's own graphs back (new=False) or our kernel nodes (new=True) and recompiles the model's layers."""
import mlx.core as mx
import mlx_redrafter.model as M
from mlx_redrafter.system import attention_kernel as ak, vector_math as vm

NEW = dict(norm=vm.rms_norm, silu=vm.silu_mul_halves, rope=ak.heads_rope, rms=M.rms_norm, tok=M.tokens_of)


def old_tok(out, gather=None):
    B, h, N, D = out.shape
    out = out.transpose(0, 2, 1, 3).reshape(B * N, h * D)
    return out if gather is None else out[gather]


def old_rms(x, weight, eps):  # the taps through MLX's fallback, the norms through the compiled graph
    return mx.fast.rms_norm(x, weight, eps) if weight is None else NEW["rms"](x, weight, eps)


def switch(model, new):
    vm.rms_norm = NEW["norm"] if new else (lambda x, w, eps: None)
    vm.silu_mul_halves = NEW["silu"] if new else (lambda gu: None)
    ak.heads_rope = NEW["rope"] if new else (lambda *a, **k: None)
    M.rms_norm = NEW["rms"] if new else old_rms
    M.tokens_of = NEW["tok"] if new else old_tok
    model.compile_layers(True)
