"""What a verification step costs as it grows: the model's own forward (`Model.__call__`) over N new tokens.

A step verifies N packed candidate tokens in one target forward; drafting pays off while that forward costs
little more than a one-token step. For each N this times the forward (after a fixed context, causal mask, the
model's default positions), its ratio to N = 1, the cost per token, and the Python graph building alone (the
forward built but not evaluated), as medians over interleaved repeats.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import mlx.core as mx

from mlx_redrafter.model import Model


def _forward_s(m: Model, cache, context: int, N: int, build_only: bool = False) -> float:
    """Seconds of one forward over N new tokens after `context` cached ones (graph building only if asked)."""
    cache.truncate(context)  # the previous forward's entries are scratch again
    tokens = mx.arange(N, dtype=mx.int32)[None] + 100
    t0 = time.perf_counter()
    out = m(tokens, cache)
    built = time.perf_counter()
    mx.eval(out)
    return (built if build_only else time.perf_counter()) - t0


def profile(m: Model, Ns: list[int], context: int = 200, repeats: int = 15) -> dict[str, Any]:
    """Median ms of the forward and of its graph building per N, with the ratio to N = 1."""
    cache = m.make_cache(context + max(Ns))
    m(mx.zeros((1, context), dtype=mx.int32), cache)
    cache.advance(context)
    mx.eval(cache.state())
    for N in Ns:
        _forward_s(m, cache, context, N)  # warm-up: every shape once
    times: dict[int, list[float]] = {N: [] for N in Ns}
    build: dict[int, list[float]] = {N: [] for N in Ns}
    for _ in range(repeats):
        for N in Ns:  # interleaved, so a change in machine load touches every N alike
            times[N].append(_forward_s(m, cache, context, N))
            build[N].append(_forward_s(m, cache, context, N, build_only=True))
    rows = []
    for N in Ns:
        full = 1000 * statistics.median(times[N])
        rows.append({"N": N, "full_ms": round(full, 2), "per_token_ms": round(full / N, 3),
                     "graph_build_ms": round(1000 * statistics.median(build[N]), 2)})
    one = rows[0]["full_ms"]
    for r in rows:
        r["vs_N1"] = round(r["full_ms"] / one, 3)
    return {"context": context, "repeats": repeats, "rows": rows}


def markdown(res: dict[str, Any], title: str) -> str:
    """The profile as a table."""
    cols = ["full_ms", "vs_N1", "per_token_ms", "graph_build_ms"]
    lines = [f"# {title}", "", f"One target forward (`Model.__call__`) over N new tokens after a "
             f"{res['context']}-token context, median of {res['repeats']} interleaved repeats (ms); `vs_N1` = "
             f"the forward's time over that of N = {res['rows'][0]['N']}; `graph_build_ms` = building the "
             "forward's graph in Python, not evaluating it.", "",
             "| N | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for r in res["rows"]:
        lines.append(f"| {r['N']} | " + " | ".join(str(r[c]) for c in cols) + " |")
    return "\n".join(lines) + "\n"
