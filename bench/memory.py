"""`python -m bench memory`: memory of target + drafter + scratch KV vs AR alone and vs mlx-lm, per dtype.

Computed (exact, from the loaded arrays): the target's parameter bytes, the drafter's (as `resolve_drafter`
loads it for that target: cast to the activation dtype), KV bytes per token, the committed KV of a context and
the scratch KV a speculative step writes past it (its verify budget: (W + lookup width) x L positions, which
`generate_speculative` pre-allocates). Measured: MLX's peak allocator memory (`mx.get_peak_memory`, reset at the
start of each generation, so resident weights count) of our AR (no drafter loaded yet), our speculative decoding
(shipped drafter, the default W=1 + lookup 1, L=3) and mlx-lm's AR (`generate_step` on an `mlx_lm` Llama sharing
our weight arrays), on one short prompt. Overhead = what speculative decoding adds to the target's own memory
(weights + KV): the goal is <= 25%.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from .report import save_report

OUT = Path(__file__).resolve().parent / "results" / "cpu"
PROMPT = "Write a short poem about the sea."
CONTEXTS = (512, 2048)  # contexts for the computed KV columns
TOKENS = {"float32": 32, "float16": 16, "bfloat16": 16, "quantized": 6}  # new tokens measured (slow dtypes: fewer)
MB = 1e6


def param_bytes(module: Any) -> int:
    return sum(v.nbytes for _, v in tree_flatten(module.parameters()))


def kv_bytes_per_token(model: Any) -> int:
    a = model.args
    return a.num_hidden_layers * 2 * a.num_key_value_heads * a.head_dim * mx.zeros((), model.dtype).itemsize


def _mlx_lm_peak(model: Any, ids: list[int], max_tokens: int) -> float:
    from mlx_lm.generate import generate_step

    from .mlx_lm_ref import mlx_lm_model

    ref = mlx_lm_model(model)  # shares our weight arrays: no second copy
    gc.collect()
    mx.reset_peak_memory()
    for _n, _ in zip(range(max_tokens), generate_step(mx.array(ids), ref, max_tokens=max_tokens)):
        pass
    peak = mx.get_peak_memory()
    del ref
    return peak


def _quantized_copy(drafter: Any) -> Any:
    """A 4-bit (group 64) copy of a drafter, for its size."""
    from mlx_redrafter.draft.redrafter import Drafter, quantize_drafter

    copy = Drafter(drafter.args.__class__(**{**drafter.args.__dict__}))
    copy.load_weights(tree_flatten(drafter.parameters()))
    return quantize_drafter(copy, 4, 64)


def measure(dtype: str, log: Callable[[str], None] = print) -> dict[str, Any]:
    """One dtype: computed sizes and measured peaks (MB)."""
    from mlx_redrafter import api
    from mlx_redrafter.generate import collect
    from mlx_redrafter.models.loader import load_target

    gc.collect()
    mx.clear_cache()
    target = load_target(None, dtype)
    model, tok = target.model, target.tokenizer
    ids = tok.encode(PROMPT)
    n = TOKENS[dtype]
    opts = api.decode_options(max_tokens=n)  # W=1 + lookup 1, L=3
    budget = (opts.shape.width + opts.lookup.width) * opts.shape.length
    rec: dict[str, Any] = {"dtype": dtype, "activations": str(model.dtype).rsplit(".", 1)[-1],
                           "target_mb": round(param_bytes(model) / MB, 1),
                           "kv_kb_per_token": round(kv_bytes_per_token(model) / 1e3, 2),
                           "scratch_positions": budget,
                           "scratch_kv_mb": round(budget * kv_bytes_per_token(model) / MB, 2),
                           "prompt_tokens": len(ids), "new_tokens": n}
    for c in CONTEXTS:
        rec[f"kv_mb_ctx{c}"] = round(c * kv_bytes_per_token(model) / MB, 1)
    lm = api.LoadedModel(target, None, "none")
    out_ar, ar = collect(api.decode(lm, ids, api.decode_options(draft="none", max_tokens=n)))
    rec["peak_ar_mb"] = round(ar.peak_memory_gb * 1e3, 1)
    rec["peak_mlx_lm_mb"] = round(_mlx_lm_peak(model, ids, n) / MB, 1)
    drafter, name = api.resolve_drafter("default", target)
    rec["drafter"], rec["drafter_mb"] = name, round(param_bytes(drafter) / MB, 1)
    rec["drafter_4bit_mb"] = round(param_bytes(_quantized_copy(drafter)) / MB, 1)
    out_spec, spec = collect(api.decode(api.LoadedModel(target, drafter, name), ids, opts))
    rec["peak_speculative_mb"] = round(spec.peak_memory_gb * 1e3, 1)
    rec["same_tokens"] = out_ar == out_spec
    own = rec["peak_ar_mb"]
    rec["measured_overhead_mb"] = round(rec["peak_speculative_mb"] - own, 1)
    rec["measured_overhead_pct"] = round(100 * rec["measured_overhead_mb"] / own, 1)
    for c in CONTEXTS:  # computed: weights + KV of a c-token context; overhead = drafter + scratch KV
        base = rec["target_mb"] + rec[f"kv_mb_ctx{c}"]
        rec[f"computed_overhead_pct_ctx{c}"] = round(100 * (rec["drafter_mb"] + rec["scratch_kv_mb"]) / base, 1)
        rec[f"computed_overhead_4bit_drafter_pct_ctx{c}"] = round(
            100 * (rec["drafter_4bit_mb"] + rec["scratch_kv_mb"]) / base, 1)
    log(str(rec))
    del target, model, drafter, lm
    return rec


def run(dtypes: list[str], out_dir: Path = OUT, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Measure every dtype; write memory.json and memory.md under `out_dir`."""
    from mlx_redrafter.system.machine_state import MachineWatch

    from .dtype_agreement import machine_brief

    watch = MachineWatch()
    watch.start()
    rows = [measure(d, log) for d in dtypes]
    report = {"prompt": PROMPT, "contexts": CONTEXTS, "rows": rows, "goal_overhead_pct": 25,
              "machine_state": watch.stop(warn=False), "machine_now": machine_brief()}
    save_report(out_dir, "memory", report, markdown)
    return report


def markdown(report: dict[str, Any]) -> str:
    """The memory table (MB)."""
    m = report["machine_now"]
    c1, c2 = report["contexts"]
    lines = ["# Memory: target + drafter + scratch KV vs AR alone and vs mlx-lm (SmolLM2-135M, MB)", "",
             f"Measured peaks: MLX allocator peak during one generation of `{report['prompt']}` (raw text, short "
             f"context; new tokens per dtype in the table), resident weights included; speculative = shipped drafter, "
             f"W=1 + lookup 1, L=3. Computed: parameter bytes, KV bytes per token x positions. Memory does not "
             f"depend on load; machine at write time: {m['uptime']}.", "",
             "| dtype | target weights | drafter | KV / token (KB) | scratch KV | peak AR (ours) | peak speculative | "
             "peak mlx-lm AR | measured overhead | computed overhead, ctx " + f"{c1} / {c2} | 4-bit drafter: MB, "
             f"computed overhead ctx {c1} / {c2} |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(f"| {r['dtype']} | {r['target_mb']} | {r['drafter_mb']} | {r['kv_kb_per_token']} | "
                     f"{r['scratch_kv_mb']} ({r['scratch_positions']} pos.) | {r['peak_ar_mb']} | "
                     f"{r['peak_speculative_mb']} | {r['peak_mlx_lm_mb']} | {r['measured_overhead_mb']} "
                     f"({r['measured_overhead_pct']}%) | {r[f'computed_overhead_pct_ctx{c1}']}% / "
                     f"{r[f'computed_overhead_pct_ctx{c2}']}% | {r['drafter_4bit_mb']}: "
                     f"{r[f'computed_overhead_4bit_drafter_pct_ctx{c1}']}% / "
                     f"{r[f'computed_overhead_4bit_drafter_pct_ctx{c2}']}% |")
    ok = all(r["measured_overhead_pct"] <= report["goal_overhead_pct"] for r in report["rows"])
    lines += ["", f"Goal: speculative overhead <= {report['goal_overhead_pct']}% of the target's own memory: "
              f"{'met' if ok else 'NOT met'} for every dtype measured (measured overhead = peak speculative - peak "
              "AR, relative to peak AR)."]
    return "\n".join(lines) + "\n"
