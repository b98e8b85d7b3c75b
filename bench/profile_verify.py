"""Where a verification step's time goes: one target forward over N new tokens, taken apart by ablation.

The forward is rebuilt here from the model's own modules and methods (`Model.embed`, `Model.rope`, each layer's
projections, `Model.logits`) with switches: each component (projection matmuls,
vocabulary projection, attention, RoPE, KV writes, norms and residual adds) is replaced by a stand-in that
costs nothing, and its share is the full forward's median time minus the ablated one's, over interleaved
repeats. Graph building (Python) is timed without evaluating. One thread count, context 200, N = 1..16.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import mlx.core as mx

from mlx_redrafter.model import Model, apply_rope, attention, project

COMPONENTS = ("matmuls", "vocab", "attention", "rope", "kv_write", "norms")
MODEL = frozenset(["<the model's own forward>"])


def forward(m: Model, tokens: mx.array, cache, positions: mx.array, mask: mx.array | None,
            skip: frozenset[str]) -> tuple[mx.array, mx.array]:
    """Model.__call__ with components switched off (a stand-in of the same shape, no real work)."""
    B, N = tokens.shape
    x = m.embed(tokens)
    cos, sin = m.rope(positions, x.dtype)
    for i, layer in enumerate(m.model.layers):
        a = layer.self_attn
        h = x if "norms" in skip else layer.input_layernorm(x)
        if "matmuls" in skip:
            q, k, v = h, h[..., : a.n_kv_heads * a.head_dim], h[..., : a.n_kv_heads * a.head_dim]
        else:
            q, k, v = project(h, a.qkv, [a.q_proj, a.k_proj, a.v_proj])  # fused at load, as the model runs
        q = q.reshape(B, N, a.n_heads, a.head_dim)
        k = k.reshape(B, N, a.n_kv_heads, a.head_dim)
        if "rope" not in skip:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)
        v = v.reshape(B, N, a.n_kv_heads, a.head_dim).transpose(0, 2, 1, 3)
        if "kv_write" in skip:
            keys, values = cache.committed(i)
            keys, values = mx.concatenate([keys, k], axis=2), mx.concatenate([values, v], axis=2)
        else:
            keys, values = cache.write(i, k, v)
        o = q if "attention" in skip else attention(q, keys, values, a.scale, mask)
        o = o.transpose(0, 2, 1, 3).reshape(B, N, -1)
        x = (x + o[..., : x.shape[-1]]) if "matmuls" in skip else x + a.o_proj(o)
        h = x if "norms" in skip else layer.post_attention_layernorm(x)
        if "matmuls" in skip:
            x = x + h
        else:
            p = layer.mlp
            x = x + p(h)
    hidden = x if "norms" in skip else m.model.norm(x)
    return (hidden if "vocab" in skip else m.logits(hidden)), hidden


def profile(m: Model, Ns: list[int], context: int = 200, repeats: int = 15) -> dict[str, Any]:
    """Median ms of the full forward and of each component (by ablation) per N, plus graph-building ms."""
    cache = m.make_cache(context + max(Ns))
    m(mx.zeros((1, context), dtype=mx.int32), cache)
    cache.advance(context)
    mx.eval(cache.state())

    def run(N: int, skip: frozenset[str], build_only: bool = False) -> float:
        cache.offset = context
        pos = mx.arange(context, context + N)[None]
        mask = None if N == 1 else (mx.arange(context + N)[None, :] <= (mx.arange(N)[:, None] + context))[None, None]
        tokens = mx.arange(N, dtype=mx.int32)[None] + 100
        t0 = time.perf_counter()
        if skip == MODEL:  # the model's own forward, as a check on the rebuilt one
            out = m(tokens, cache, pos, mask)
        else:
            out = forward(m, tokens, cache, pos, mask, skip)
        t1 = time.perf_counter()
        if build_only:
            mx.eval(out)
            return t1 - t0
        mx.eval(out)
        return time.perf_counter() - t0

    variants = [frozenset(), MODEL] + [frozenset([c]) for c in COMPONENTS]
    rows = []
    for N in Ns:
        for v in variants:
            run(N, v)  # warm-up
        times: dict[frozenset, list[float]] = {v: [] for v in variants}
        build: list[float] = []
        for _ in range(repeats):
            for v in variants:
                times[v].append(run(N, v))
            build.append(run(N, frozenset(), build_only=True))
        med = {v: 1000 * statistics.median(t) for v, t in times.items()}
        full = med[frozenset()]
        row = {"N": N, "full_ms": round(full, 2), "model_ms": round(med[MODEL], 2),
               "graph_build_ms": round(1000 * statistics.median(build), 2)}
        for c in COMPONENTS:
            row[f"{c}_ms"] = round(full - med[frozenset([c])], 2)
        row["rest_ms"] = round(full - sum(row[f"{c}_ms"] for c in COMPONENTS), 2)
        rows.append(row)
    one = rows[0]["full_ms"]
    for r in rows:
        r["vs_N1"] = round(r["full_ms"] / one, 3)
    return {"context": context, "repeats": repeats, "rows": rows}


def markdown(res: dict[str, Any], title: str) -> str:
    """The profile as a table."""
    cols = ["full_ms", "vs_N1", "model_ms"] + [f"{c}_ms" for c in COMPONENTS] + ["rest_ms", "graph_build_ms"]
    lines = [f"# {title}", "", f"One target forward over N new tokens after a {res['context']}-token context, "
             f"median of {res['repeats']} interleaved repeats; component = full minus the forward without it "
             "(ms). `model_ms` = the model's own forward (the rebuilt one should match it); `matmuls` = the "
             "projections of every layer (q/k/v and gate/up fused), `vocab` = the 49,152-row output projection, "
             "`rest` = embedding, op dispatch and what the ablations do not separate.", "",
             "| N | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for r in res["rows"]:
        lines.append(f"| {r['N']} | " + " | ".join(str(r[c]) for c in cols) + " |")
    return "\n".join(lines) + "\n"
