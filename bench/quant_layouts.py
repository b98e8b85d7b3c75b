"""`python -m bench quant-layouts`: is there a quantized layout that is cheap on MLX's CPU backend?

The target's weights (the GGUF dequantized to float32) are re-quantized with `mx.quantize` (affine; 4 or 8 bits;
group 32 / 64 / 128 -- 128 does not divide the hidden size 576, so only the 1536-wide down projections take
128 and every other matrix 64) and run with float32, bfloat16 or float16 activations (scales and biases in the
activation dtype); the float32 dense model (what `--dtype auto` loads on a CPU backend) and the GGUF's own packed
layout (`--dtype quantized`: Q4_1 layers, Q8_0 head, float16 activations) are the references.

Measured per layout: one forward over N = 1, 4, 8 new tokens on a CTX-token context (median of the repeats;
N = 1 is an AR step, 1 / t1 the AR tokens/s ceiling, N = 4 / 8 a verify), and the weights' bytes. The cache is
filled once by the float32 model and cast to each layout's activation dtype: only the time is measured, so the
cached values need not be the layout's own (and a float16-activation prefill would take minutes).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlx_redrafter.model import Model

from .report import save_report

OUT = Path(__file__).resolve().parent / "results" / "cpu"
CTX = 200
NS = (1, 4, 8)
ACTS = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def requantized(dense: Model, bits: int, group: int, act: mx.Dtype) -> Model:
    """A copy of the float32 `dense` model with every Linear / Embedding quantized (group `group`, or 64 where
    `group` does not divide the input width) and every float in `act`."""
    m = Model(dense.args)
    m.load_weights(tree_flatten(dense.parameters()))

    def pick(_: str, mod: nn.Module) -> dict | bool:
        if not isinstance(mod, (nn.Linear, nn.Embedding)):
            return False
        return {"group_size": group if mod.weight.shape[-1] % group == 0 else 64, "bits": bits}

    nn.quantize(m, class_predicate=pick)
    m.apply(lambda x: x.astype(act) if mx.issubdtype(x.dtype, mx.floating) else x)
    mx.eval(m.parameters())
    return m


def nbytes(model: Model) -> int:
    """Bytes of every parameter (packed weights, scales and biases included)."""
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def time_forwards(model: Model, cache: Any, repeats: int) -> dict[int, float]:
    """Median seconds of one forward over N new tokens (the cache is left as it was: nothing is committed)."""
    out = {}
    for n in NS:
        runs = []
        for r in range(repeats + 1):  # the first run warms up (and compiles kernels)
            t0 = time.perf_counter()
            logits, _ = model(mx.array([[1000 + i for i in range(n)]]), cache)
            mx.eval(logits)
            if r:
                runs.append(time.perf_counter() - t0)
        out[n] = statistics.median(runs)
    return out


def cast_cache(cache: Any, act: mx.Dtype) -> Any:
    c = cache.copy()
    c.keys = [None if k is None else k.astype(act) for k in c.keys]
    c.values = [None if v is None else v.astype(act) for v in c.values]
    mx.eval(c.state())
    return c


def layouts() -> list[tuple[str, int | None, int | None, str]]:
    """(name, bits, group, activations): the measured grid (float16 activations on fewer cells: they are the
    slowest and the cost does not depend on bits or group, see the float32 rows)."""
    grid = [(f"q{b}g{g}", b, g, a) for a in ("float32", "bfloat16") for b in (4, 8) for g in (32, 64, 128)]
    return grid + [(f"q{b}g64", b, 64, "float16") for b in (4, 8)]


def run(repeats: int = 3, slow_repeats: int = 1, out_dir: Path = OUT,
        log: Callable[[str], None] = print) -> dict[str, Any]:
    """Measure every layout; write quant-layouts.json and quant-layouts.md under `out_dir`."""
    from mlx_redrafter.models.loader import load_target
    from mlx_redrafter.system.machine_state import MachineWatch

    from .dtype_agreement import machine_brief

    watch = MachineWatch()
    watch.start()
    dense = load_target(None, "float32").model
    cache = dense.make_cache(CTX + 16)
    dense(mx.array([[100 + (i * 37) % 20000 for i in range(CTX)]]), cache, last_only=True)
    cache.advance(CTX)
    mx.eval(cache.state())
    rows = []

    def record(name: str, model: Model, act: str, reps: int) -> None:
        t = time_forwards(model, cast_cache(cache, ACTS[act]), reps)
        rows.append({"layout": name, "activations": act, "weights_mb": round(nbytes(model) / 1e6, 1),
                     **{f"ms_n{n}": round(1e3 * t[n], 1) for n in NS},
                     "ar_tokens_per_s": round(1 / t[1], 2), "verify4_over_1": round(t[4] / t[1], 2),
                     "verify8_over_1": round(t[8] / t[1], 2)})
        log(str(rows[-1]))

    record("float32 dense (auto on CPU)", dense, "float32", repeats)
    for name, bits, group, act in layouts():
        m = requantized(dense, bits, group, ACTS[act])
        record(name, m, act, repeats if act != "float16" else slow_repeats)
        del m
    gguf = load_target(None, "quantized").model
    record("GGUF packed (Q4_1 + Q8_0 head; --dtype quantized)", gguf, "float16", slow_repeats)
    base = rows[0]
    for r in rows:
        r["ar_slowdown_vs_float32"] = round(r["ms_n1"] / base["ms_n1"], 2)
    report = {"context_tokens": CTX, "repeats": repeats, "slow_repeats": slow_repeats, "rows": rows,
              "machine_state": watch.stop(warn=True), "machine_now": machine_brief()}
    save_report(out_dir, "quant-layouts", report, markdown)
    return report


def markdown(report: dict[str, Any]) -> str:
    """The table, fastest first, with the machine state."""
    m = report["machine_now"]
    quiet = report["machine_state"]["quiet"]
    lines = ["# Quantized layouts on MLX's CPU backend (SmolLM2-135M, one forward over N new tokens)", "",
             f"Context {report['context_tokens']} tokens; median of {report['repeats']} runs (float16-activation "
             f"rows: {report['slow_repeats']}). Machine {'quiet' if quiet else 'NOT quiet (shared: ratios only)'}: "
             f"{m['uptime']}; busy: {m['busy'] or 'none'}.", "",
             "| layout | activations | weights MB | N=1 ms | N=4 ms | N=8 ms | AR tok/s (1/t1) | N=1 vs float32 | "
             "N=4 / N=1 | N=8 / N=1 |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(report["rows"], key=lambda r: r["ms_n1"]):
        lines.append(f"| {r['layout']} | {r['activations']} | {r['weights_mb']} | {r['ms_n1']} | {r['ms_n4']} | "
                     f"{r['ms_n8']} | {r['ar_tokens_per_s']} | {r['ar_slowdown_vs_float32']}x | "
                     f"{r['verify4_over_1']} | {r['verify8_over_1']} |")
    return "\n".join(lines) + "\n"
