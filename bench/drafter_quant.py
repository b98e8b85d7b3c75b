"""`python -m bench drafter-quant`: the shipped drafter quantized to 8 and 4 bits vs as shipped (float16 weights).

Acceptance: tokens per target call of greedy `rnn` decoding with the float32 target on MT-bench first turns (held
out: the drafter never trained on them), per W x L, each drafter kept as it is (quantized: `QuantizedLinear`
with float32 scales, as `load_drafter` builds it). Drafting time: per step of those runs (`Stats.phase_s`, draft
+ pack, at the step's syncs) and a beam-search micro-benchmark per drafter form -- kept quantized, dequantized
(what `api.resolve_drafter` now hands a float32 target on a CPU backend) and, for reference, float16
activations (what a float16 / quantized target would run; slow on this backend).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx

from .report import save_report

OUT = Path(__file__).resolve().parent / "results" / "cpu"
SHAPES = [(1, 3), (1, 5), (4, 3)]  # (W, L): the shipped default, a longer beam, a wider one
GROUP = 64


def drafter_bytes(d: Any) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for k, v in tree_flatten(d.parameters()) if k != "draft_vocab")


def time_beam_search(drafter: Any, embed: Callable, context: mx.array, width: int, length: int,
                     repeats: int) -> float:
    """Median ms of one beam search (W beams of length L) from one context, evaluated."""
    from mlx_redrafter.draft.beam_search import beam_search

    g0 = mx.array([504], dtype=mx.int32)
    runs = []
    for r in range(repeats + 1):
        t0 = time.perf_counter()
        mx.eval(beam_search(drafter, embed, context, g0, width, length))
        if r:
            runs.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(runs)


def run(num_prompts: int = 12, max_tokens: int = 128, repeats: int = 20, out_dir: Path = OUT,
        log: Callable[[str], None] = print) -> dict[str, Any]:
    """Quantize, decode, time; write quantized-drafter.json / .md under `out_dir`."""
    from mlx_redrafter import api
    from mlx_redrafter.draft.redrafter import dequantize_drafter, load_drafter, quantize_drafter, save_drafter
    from mlx_redrafter.generate import collect
    from mlx_redrafter.prompts import first_turns
    from mlx_redrafter.system.machine_state import MachineWatch

    from .dtype_agreement import machine_brief

    watch = MachineWatch()
    watch.start()
    target = api.load_target(None, "float32")
    shipped_dir = api.shipped_drafter_path(target.name)
    tmp = Path(tempfile.mkdtemp(prefix="drafter-quant-"))
    dirs = {"shipped (float16 weights)": shipped_dir}
    for bits in (8, 4):
        dirs[f"{bits}-bit g{GROUP}"] = save_drafter(quantize_drafter(load_drafter(shipped_dir), bits, GROUP),
                                                    tmp / f"q{bits}")
    prompts = [api.encode_prompt(api.LoadedModel(target, None, "none"), r["prompt"])
               for r in first_turns(None, num_prompts)]
    h = mx.random.normal((1, target.model.args.hidden_size), key=mx.random.key(0))
    embed = target.model.embed
    variants = []
    for name, path in dirs.items():
        kept = load_drafter(path, dtype=mx.float32)  # quantized ones stay quantized (float32 scales)
        lm = api.LoadedModel(target, kept, name)
        rec: dict[str, Any] = {"drafter": name, "dir": str(path), "bytes_mb": round(drafter_bytes(kept) / 1e6, 2),
                               "quantization": kept.args.quantization, "acceptance": []}
        for w, length in SHAPES:
            opts = api.decode_options(draft="rnn", beam_width=w, beam_length=length, max_tokens=max_tokens)
            steps, decided, draft_s, per_prompt = 0, 0.0, 0.0, []
            for ids in prompts:
                _, st = collect(api.decode(lm, ids, opts))
                per_prompt.append(st.tokens_per_step)
                steps += st.steps
                decided += st.tokens_per_step * st.steps
                draft_s += st.phase_s["draft"]
            rec["acceptance"].append({"W": w, "L": length, "tokens_per_step": round(sum(per_prompt) / len(prompts), 4),
                                      "tokens_per_step_pooled": round(decided / max(steps, 1), 4), "steps": steps,
                                      "draft_ms_per_step": round(1e3 * draft_s / max(steps, 1), 2)})
            log(f"{name} W={w} L={length}: {rec['acceptance'][-1]}")
        forms = {"as loaded (float32 activations)": kept}
        if kept.args.quantization:
            forms["dequantized to float32 (resolve_drafter on CPU)"] = dequantize_drafter(load_drafter(path))
        forms["float16 activations"] = load_drafter(path, dtype=mx.float16)
        rec["beam_search_ms"] = {}
        for form, d in forms.items():
            act = mx.float16 if form.startswith("float16") else mx.float32
            ctx = h.astype(act)
            emb = (lambda t: embed(t).astype(mx.float16)) if act == mx.float16 else embed
            rec["beam_search_ms"][form] = {f"W{w}L{length}": round(time_beam_search(d, emb, ctx, w, length, repeats),
                                                                   2) for w, length in SHAPES}
            log(f"{name} {form}: {rec['beam_search_ms'][form]}")
        variants.append(rec)
    report = {"model": target.name, "prompts": f"MT-bench first turns 1-{num_prompts} (held out)",
              "max_tokens": max_tokens, "group_size": GROUP, "shapes": SHAPES, "variants": variants,
              "machine_state": watch.stop(warn=True), "machine_now": machine_brief()}
    save_report(out_dir, "quantized-drafter", report, markdown)
    return report


def markdown(report: dict[str, Any]) -> str:
    """Acceptance and drafting-time tables."""
    m = report["machine_now"]
    quiet = report["machine_state"]["quiet"]
    shapes = [f"W{w}L{length}" for w, length in report["shapes"]]
    lines = ["# The shipped drafter quantized (8 / 4 bits, group 64) vs as shipped", "",
             f"Target {report['model']} in float32 (MLX CPU + MKL, MKL_NUM_THREADS=1); {report['prompts']}, "
             f"{report['max_tokens']} new tokens, greedy, draft mode rnn. Machine "
             f"{'quiet' if quiet else 'NOT quiet (shared: times are for ratios only)'}: {m['uptime']}; busy: "
             f"{m['busy'] or 'none'}.", "",
             "Tokens per target call (mean over prompts) and drafting ms per step (draft + pack, at the step's syncs):",
             "", "| drafter | MB | " + " | ".join(f"{s} tok/call | {s} draft ms" for s in shapes) + " |",
             "|---|---|" + "---|---|" * len(shapes)]
    for v in report["variants"]:
        cells = " | ".join(f"{a['tokens_per_step']:.3f} | {a['draft_ms_per_step']:.1f}" for a in v["acceptance"])
        lines.append(f"| {v['drafter']} | {v['bytes_mb']} | {cells} |")
    lines += ["", "Beam search alone (median ms, one context):", "",
              "| drafter | form | " + " | ".join(shapes) + " |", "|---|---|" + "---|" * len(shapes)]
    for v in report["variants"]:
        for form, t in v["beam_search_ms"].items():
            lines.append(f"| {v['drafter']} | {form} | " + " | ".join(str(t[s]) for s in shapes) + " |")
    return "\n".join(lines) + "\n"
