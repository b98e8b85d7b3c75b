"""`python -m bench dtype-agreement`: greedy speculative output vs AR output of the same dtype, on the full model.

Per dtype and MT-bench prompt (first turns, spread over the categories, chat-formatted): our AR
(`generate_ar`) and five speculative runs (`generate_speculative`: rnn with the shipped and a random drafter,
lookup, rnn+lookup with each drafter), compared with `bench.agreement.compare` (the tie-aware rule).
The prompt minus its last token is prefilled once; every run continues a copy of that cache, so all runs see
the same committed prompt keys and values.

Calibration of the tie bound (the first `--calibrate` prompts): the AR continuation's logits computed three
ways -- one token at a time (the AR path), in blocks of 4 (a verify-shaped path) and in one full forward (what
the tie check runs) -- and, per position, how far the top-2 difference of the AR path moves in the other two,
in units of EPSILON[dtype] * max |logit|. A flip needs a move larger than the AR path's gap, so the largest moves
bound the gap of any rounding flip; `agreement.TIE_FACTOR` must exceed their sum.

Raw records: OUT/agreement-<dtype>.json (rewritten after every prompt); summary: OUT/agreement.json and
OUT/README.md, rebuilt from every raw file present. Quantized runs fewer prompts, tokens and runs: on a CPU
backend its float16-activation matmuls cost ~4.5 s per token row (see README).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx

from bench.agreement import EPSILON, FP32_TIE, TIE_FACTOR, compare, dtype_name, tie_bound
from mlx_redrafter.files import write_atomic

OUT_DIR = Path(__file__).resolve().parent / "results" / "cpu" / "dtype-agreement"
LENGTH = 3  # candidate length L (first token included): the shipped default
BLOCK = 4  # rows per block in the calibration's verify-shaped path
# (name, draft mode, drafter, rnn width, lookup width)
RUNS = [("rnn/shipped", "rnn", "shipped", 1, 0), ("rnn/random", "rnn", "random", 2, 0),
        ("lookup", "lookup", None, 0, 1), ("rnn+lookup/shipped", "rnn+lookup", "shipped", 1, 1),
        ("rnn+lookup/random", "rnn+lookup", "random", 1, 1)]
QUANTIZED_RUNS = ("rnn/random", "lookup", "rnn+lookup/shipped")


def _allocator(target: Any, drafters: dict[str, Any], draft: str, drafter: str | None, rnn_w: int,
               lookup_w: int) -> Any:
    """The runtime's allocator (`api.make_allocator`) for one run: ngram lookup, adaptive."""
    from mlx_redrafter import api

    lm = api.LoadedModel(target, drafters[drafter] if drafter else None, drafter or "none")
    return api.make_allocator(lm, api.decode_options(draft=draft, beam_width=max(rnn_w, 1), beam_length=LENGTH,
                                                        lookup_width=max(lookup_w, 1)))


def _rows_one_by_one(model: Any, cache: Any, tokens: list[int]) -> mx.array:
    out = []
    for t in tokens:
        logits, _ = model(mx.array([[t]]), cache)
        cache.advance(1)
        out.append(logits[0, -1].astype(mx.float32))
        mx.eval(out[-1], cache.state())
    return mx.stack(out)


def _rows_in_blocks(model: Any, cache: Any, tokens: list[int], block: int) -> mx.array:
    out = []
    for i in range(0, len(tokens), block):
        chunk = tokens[i: i + block]
        logits, _ = model(mx.array([chunk]), cache)
        cache.advance(len(chunk))
        out.append(logits[0].astype(mx.float32))
        mx.eval(out[-1], cache.state())
    return mx.concatenate(out)


def calibrate(model: Any, base: Any, prompt: list[int], ar: list[int], positions: int) -> list[dict[str, float]]:
    """Per AR position: max |logit| of the AR path and how far its top-2 difference (and any logit) moves in the
    block path and in the full forward, all in logit units."""
    fed = [prompt[-1]] + ar[: positions - 1]
    a = _rows_one_by_one(model, base.copy(), fed)
    b = _rows_in_blocks(model, base.copy(), fed, BLOCK)
    full = prompt + ar[: positions - 1]
    _, hidden = model(mx.array([full]), model.make_cache(len(full)), last_only=True)
    c = model.logits(model.last_state(hidden)[:, -len(fed):])[0].astype(mx.float32)
    mx.eval(a, b, c)
    recs = []
    for i in range(len(fed)):
        order = mx.argsort(a[i])
        t1, t2 = order[-1].item(), order[-2].item()
        pair = a[i, t1] - a[i, t2]
        recs.append({"scale": mx.abs(a[i]).max().item(), "gap": pair.item(),
                     "move_block": abs((pair - (b[i, t1] - b[i, t2])).item()),
                     "move_full": abs((pair - (c[i, t1] - c[i, t2])).item()),
                     "max_diff_block": mx.abs(a[i] - b[i]).max().item(),
                     "max_diff_full": mx.abs(a[i] - c[i]).max().item()})
    return recs


def run_dtype(dtype: str, num_prompts: int, max_tokens: int, calibrate_prompts: int, calibrate_positions: int,
              runs: list[tuple], out: Path, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every run on every prompt for one dtype; the raw record is rewritten to `out` after each prompt."""
    from mlx_redrafter.api import resolve_drafter
    from mlx_redrafter.draft.redrafter import random_drafter
    from mlx_redrafter.generate import collect, generate_ar, generate_speculative
    from mlx_redrafter.models.loader import load_target
    from mlx_redrafter.prompts import first_turns
    from mlx_redrafter.system.machine_state import MachineWatch

    watch = MachineWatch()
    watch.start()
    target = load_target(None, dtype)
    model, tok = target.model, target.tokenizer
    shipped, shipped_name = resolve_drafter("default", target)
    a = model.args
    drafters = {"shipped": shipped,
                "random": random_drafter(a.hidden_size, a.vocab_size, seed=0, exit_dim=128, draft_vocab_size=4096,
                                         dtype=model.dtype)}
    rows = first_turns(None, num_prompts, spread=True)
    rec: dict[str, Any] = {"dtype": dtype, "activations": dtype_name(model), "model": target.name,
                           "drafters": {"shipped": shipped_name, "random": "random:0 (exit_dim 128, K=4096)"},
                           "max_tokens": max_tokens, "length": LENGTH, "runs": [r[0] for r in runs],
                           "prompts": [], "calibration": []}
    t_start = time.perf_counter()
    for k, row in enumerate(rows):
        prompt = tok.encode_chat([{"role": "user", "content": row["prompt"]}])
        base = model.make_cache(len(prompt) + max_tokens + 16)
        model(mx.array([prompt[:-1]]), base, last_only=True)
        base.advance(len(prompt) - 1)
        mx.eval(base.state())
        t0 = time.perf_counter()
        ar, _ = collect(generate_ar(model, prompt[-1:], max_tokens=max_tokens, eos_ids=tok.eos_ids, cache=base.copy(),
                                    history=prompt[:-1]))
        prec: dict[str, Any] = {"id": row.get("question_id", k), "category": row.get("category", ""),
                                "prompt_tokens": len(prompt), "ar_tokens": len(ar),
                                "ar_s": round(time.perf_counter() - t0, 1), "runs": {}}
        for name, draft, drafter, rnn_w, lookup_w in runs:
            t0 = time.perf_counter()
            got, st = collect(generate_speculative(model, prompt[-1:], _allocator(target, drafters, draft, drafter,
                                                                                  rnn_w, lookup_w),
                                                   length=LENGTH, max_tokens=max_tokens, eos_ids=tok.eos_ids,
                                                   cache=base.copy(), history=prompt[:-1]))
            ag = compare(model, prompt, ar, got)
            prec["runs"][name] = {**ag.as_dict(), "tokens_per_step": round(st.tokens_per_step, 3),
                                  "steps": st.steps, "seconds": round(time.perf_counter() - t0, 1)}
            log(f"{dtype} prompt {k + 1}/{len(rows)} {name}: matched {ag.matched}/{ag.tokens}"
                + ("" if ag.equal else f", first diff {ag.first_diff} gap {ag.gap:.3g} bound {ag.bound:.3g}"))
        if k < calibrate_prompts:
            t0 = time.perf_counter()
            positions = min(calibrate_positions, len(ar))
            rec["calibration"] += [{"prompt": prec["id"], "position": i, **r}
                                   for i, r in enumerate(calibrate(model, base, prompt, ar, positions))]
            log(f"{dtype} prompt {k + 1}: calibrated {positions} positions in {time.perf_counter() - t0:.0f} s")
        rec["prompts"].append(prec)
        rec["elapsed_s"] = round(time.perf_counter() - t_start, 1)
        write_atomic(out, json.dumps(rec, indent=1) + "\n")
    rec["machine_state"] = watch.stop(warn=False)
    write_atomic(out, json.dumps(rec, indent=1) + "\n")
    return rec


def mlx_lm_check(dtypes: list[str], text: str = "The capital of France is Paris. The capital of Italy is",
                 out_dir: Path = OUT_DIR, log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Our full model vs mlx-lm's Llama on the same (packed) weights: max |difference| of the post-norm hidden
    states (every position) and of the last position's logits, in units of EPSILON * max |value|."""
    from mlx_redrafter.models.loader import load_target

    from .mlx_lm_ref import mlx_lm_model

    rows = []
    for dtype in dtypes:
        target = load_target(None, dtype)
        model = target.model
        ids = mx.array([target.tokenizer.encode(text)])
        ref = mlx_lm_model(model)
        logits, hidden = model(ids, model.make_cache(ids.shape[1]), last_only=True)
        ref_hidden = ref.model(ids)
        ref_logits = ref.model.embed_tokens.as_linear(ref_hidden[:, -1:])
        u = EPSILON[dtype_name(model)]
        rec: dict[str, Any] = {"dtype": dtype, "tokens": ids.shape[1],
                               "same_argmax": mx.argmax(logits[0, -1]).item() == mx.argmax(ref_logits[0, -1]).item()}
        for what, a, b in (("hidden", hidden, ref_hidden), ("logits", logits, ref_logits)):
            a, b = a.astype(mx.float32), b.astype(mx.float32)
            diff, scale = mx.abs(a - b).max().item(), mx.abs(b).max().item()
            rec[what] = {"max_abs_diff": diff, "max_abs": scale, "in_eps_scale": round(diff / (u * scale), 2)}
        rows.append(rec)
        log(str(rec))
        del target, model, ref
    write_atomic(out_dir / "mlx-lm-logits.json", json.dumps(rows, indent=2) + "\n")
    return rows


def float32_reference(target: Any) -> Any:
    """The same weights computed in float32: the float32 load for a float dtype; for quantized weights, the same
    packed arrays with float32 scales, biases and activations (only the activation rounding differs)."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from mlx_redrafter.model import Model
    from mlx_redrafter.models.loader import load_target

    if target.dtype != "quantized":
        return load_target(None, "float32").model
    src = target.model
    quant = {name: {"group_size": m.group_size, "bits": m.bits} for name, m in src.named_modules()
             if hasattr(m, "group_size") and hasattr(m, "bits")}
    ref = Model(src.args)
    nn.quantize(ref, class_predicate=lambda path, _: quant.get(path, False))
    ref.load_weights([(k, v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v)
                      for k, v in tree_flatten(src.parameters())], strict=True)
    mx.eval(ref.parameters())
    return ref


def calibrate_vs_float32(dtype: str, num_prompts: int, positions: int, out_dir: Path = OUT_DIR,
                         log: Callable[[str], None] = print) -> list[dict[str, float]]:
    """How far rounding in `dtype` moves the top-2 logit difference from the same weights computed in float32:
    per position of prompt + a greedy float32 continuation, |(l[t1] - l[t2]) - (r[t1] - r[t2])| for the top-2
    pair of either side (l: one full forward in `dtype`, r: float32), with max |l|. Any two computation orders
    in `dtype` then move a top-2 difference by at most twice the largest of these (both stray from float32).

    Also the flips rounding causes: AR in `dtype` vs AR of the float32 reference on each prompt, judged by
    `compare` (the gap of the `dtype` path where they first differ): real rounding flips to set the bound by."""
    from mlx_redrafter.generate import collect, generate_ar
    from mlx_redrafter.models.loader import load_target
    from mlx_redrafter.prompts import first_turns

    target = load_target(None, dtype)
    model, tok = target.model, target.tokenizer
    ref = float32_reference(target)
    dense32 = ref if dtype != "quantized" else load_target(None, "float32").model
    recs, flips = [], []
    for k, row in enumerate(first_turns(None, num_prompts, spread=True)):
        prompt = tok.encode_chat([{"role": "user", "content": row["prompt"]}])
        cont = collect(generate_ar(dense32, prompt, max_tokens=positions, eos_ids=tok.eos_ids))[0]
        ar_ref = cont if ref is dense32 else collect(generate_ar(ref, prompt, max_tokens=positions,
                                                                 eos_ids=tok.eos_ids))[0]
        ar = collect(generate_ar(model, prompt, max_tokens=positions, eos_ids=tok.eos_ids))[0]
        flips.append({"prompt": row.get("question_id", k), **compare(model, prompt, ar, ar_ref).as_dict()})
        seq = prompt + cont[:-1]
        n = len(cont)
        rows = []
        for m in (model, ref):
            _, hidden = m(mx.array([seq]), m.make_cache(len(seq)), last_only=True)
            rows.append(m.logits(m.last_state(hidden)[:, -n:])[0].astype(mx.float32))
        lo, r32 = rows
        mx.eval(lo, r32)
        for i in range(n):
            dev = 0.0
            for side in (lo[i], r32[i]):
                order = mx.argsort(side)
                t1, t2 = order[-1].item(), order[-2].item()
                dev = max(dev, abs(((lo[i, t1] - lo[i, t2]) - (r32[i, t1] - r32[i, t2])).item()))
            recs.append({"prompt": row.get("question_id", k), "position": i, "dev_top2": dev,
                         "max_diff": mx.abs(lo[i] - r32[i]).max().item(), "scale": mx.abs(lo[i]).max().item()})
        log(f"{dtype} prompt {k + 1}: {n} positions vs float32; AR vs float32 AR: {flips[-1]}")
        write_atomic(out_dir / f"calibration-{dtype}.json",
                     json.dumps({"positions": recs, "ar_vs_float32": flips}, indent=1) + "\n")
    return recs


def _max(vals: list[float]) -> float | None:
    return max(vals) if vals else None


def summarize(rec: dict[str, Any], cal32: dict[str, list] | None = None) -> dict[str, Any]:
    """Per dtype: calibration maxima (in EPSILON * max|logit| units; `cal32` from `calibrate_vs_float32`), the
    bound, and per run the token match rate, equal / tie / real divergence counts and the largest flip gap (also
    relative to its bound)."""
    act = rec["activations"]
    u = EPSILON[act]
    cal = rec["calibration"]
    cal32 = cal32 or {"positions": [], "ar_vs_float32": []}
    dev32 = [c["dev_top2"] / (u * c["scale"]) for c in cal32["positions"]]
    cross = [f for f in cal32["ar_vs_float32"] if f["first_diff"] is not None]
    rel = {key: _max([c[key] / (u * c["scale"]) for c in cal]) for key in
           ("move_block", "move_full", "max_diff_block", "max_diff_full")}
    runs = {}
    for name in rec["runs"]:
        rs = [p["runs"][name] for p in rec["prompts"] if name in p["runs"]]
        divs = [r for r in rs if r["first_diff"] is not None]
        for r in divs:  # judged with today's bound (the raw gap and scale are stored)
            r["bound"] = tie_bound(act, r["scale"])
            r["tie"] = r["gap"] <= r["bound"]
        runs[name] = {
            "prompts": len(rs), "tokens": sum(r["tokens"] for r in rs), "matched": sum(r["matched"] for r in rs),
            "token_match_rate": round(sum(r["matched"] for r in rs) / max(sum(r["tokens"] for r in rs), 1), 4),
            "mean_match_rate": round(sum(r["match_rate"] for r in rs) / max(len(rs), 1), 4),
            "equal": sum(r["first_diff"] is None for r in rs), "ties": sum(r["tie"] for r in divs),
            "real": sum(not r["tie"] for r in divs),
            "max_flip_gap": _max([r["gap"] for r in divs]),
            "max_flip_gap_over_bound": _max([r["gap"] / r["bound"] for r in divs]),
            "tokens_per_step": round(sum(r["tokens_per_step"] for r in rs) / max(len(rs), 1), 3)}
    flips = [p["runs"][n] for p in rec["prompts"] for n in p["runs"] if p["runs"][n]["first_diff"] is not None]
    return {"dtype": rec["dtype"], "activations": act, "epsilon": u,
            "tie_factor": TIE_FACTOR.get(act), "fp32_tie": FP32_TIE if act == "float32" else None,
            "prompts": len(rec["prompts"]), "max_tokens": rec["max_tokens"],
            "calibration_positions": len(cal), "calibration_max_in_eps_scale": rel,
            "calibration_max_scale": _max([c["scale"] for c in cal]),
            "calibration_min_ar_gap": min([c["gap"] for c in cal]) if cal else None,
            "paths_move_sum": (rel["move_block"] + rel["move_full"]) if cal else None,
            "vs_float32_positions": len(dev32), "vs_float32_max_top2_move": _max(dev32),
            "vs_float32_p99_top2_move": sorted(dev32)[int(0.99 * (len(dev32) - 1))] if dev32 else None,
            "vs_float32_max_any_logit": _max([c["max_diff"] / (u * c["scale"]) for c in cal32["positions"]]),
            "ar_vs_float32_prompts": len(cal32["ar_vs_float32"]), "ar_vs_float32_flips": len(cross),
            "ar_vs_float32_max_flip_gap": _max([f["gap"] for f in cross]),
            "ar_vs_float32_max_flip_gap_in_eps_scale": _max([f["gap"] / (u * f["scale"]) for f in cross]),
            "required_tie_factor": 2 * _max(dev32) if dev32 else None,
            "max_flip_gap": _max([f["gap"] for f in flips]),
            "max_flip_gap_over_bound": _max([f["gap"] / tie_bound(act, f["scale"]) for f in flips]),
            "runs": runs, "elapsed_s": rec.get("elapsed_s"),
            "machine_quiet": rec.get("machine_state", {}).get("quiet"),
            "machine_reasons": rec.get("machine_state", {}).get("reasons", [])}


def _fmt(x: Any, spec: str = ".3g") -> str:
    return "-" if x is None else format(x, spec)


def markdown(summaries: list[dict[str, Any]], machine: dict[str, Any]) -> str:
    """The README of the report."""
    lines = ["# Speculative vs AR agreement per dtype (greedy, full SmolLM2-135M, MLX CPU)", "",
             f"Machine state when the report was written: {machine['uptime']}; busy processes: "
             f"{machine['busy'] or 'none'}. Each dtype's run records its own state (`machine_state` in "
             "agreement-<dtype>.json): the CPU was shared with other jobs (a niced data job, other agents' tests), "
             "so seconds are for ratios only; token agreement does not depend on load.", "",
             "Rule (`bench/agreement.py`): at the first token where a speculative output differs from AR of "
             "the same dtype, the AR path's top-2 logit gap (one full forward over prompt + common prefix) is "
             "compared with `TIE_FACTOR * EPSILON * max|logit|` (float32: an absolute 1e-4); "
             "EPSILON is the activation dtype's unit roundoff (quantized weights run float16 activations). "
             "Bound: the dtype's top-2 difference strays from the same weights computed in float32 by at most D "
             "(measured below, units of EPSILON * max|logit|); two computation orders in the dtype (a packed "
             "verify and a one-token step) can then flip a pair only if AR's gap is <= 2D; TIE_FACTOR >= 2 x 2D.",
             "", "| dtype | prompts x tokens | runs | token match | spec vs AR: equal / ties / real | largest "
             "spec-vs-AR flip gap | D: max top-2 move vs float32 | required 2D | TIE_FACTOR | AR vs float32 AR: "
             "flips / prompts | largest such flip gap (in EPSILON*scale) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        rs = s["runs"].values()
        toks, matched = sum(r["tokens"] for r in rs), sum(r["matched"] for r in rs)
        eq, ties, real = (sum(r[k] for r in rs) for k in ("equal", "ties", "real"))
        f32 = s["activations"] == "float32"
        factor = "1e-4 (absolute)" if f32 else _fmt(s["tie_factor"])
        cross = "-" if f32 else f"{s['ar_vs_float32_flips']} / {s['ar_vs_float32_prompts']}"
        cross_gap = "-" if f32 or s["ar_vs_float32_max_flip_gap"] is None else (
            f"{s['ar_vs_float32_max_flip_gap']:.3g} ({s['ar_vs_float32_max_flip_gap_in_eps_scale']:.2f})")
        lines.append(f"| {s['dtype']} | {s['prompts']} x {s['max_tokens']} | {len(s['runs'])} | "
                     f"{matched / max(toks, 1):.3f} | {eq} / {ties} / {real} | {_fmt(s['max_flip_gap'])} | "
                     f"{'-' if f32 else _fmt(s['vs_float32_max_top2_move'], '.2f')} | "
                     f"{'-' if f32 else _fmt(s['required_tie_factor'], '.2f')} | {factor} | {cross} | {cross_gap} |")
    lines += ["", "Per run (token match = common-prefix tokens / tokens over all prompts; tokens/step = tokens "
              "decided per target call):", "",
              "| dtype | run | token match | mean match | equal | ties | real | largest flip gap | tokens/step |",
              "|---|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        for name, r in s["runs"].items():
            lines.append(f"| {s['dtype']} | {name} | {r['token_match_rate']:.3f} | {r['mean_match_rate']:.3f} | "
                         f"{r['equal']}/{r['prompts']} | {r['ties']} | {r['real']} | {_fmt(r['max_flip_gap'])} | "
                         f"{r['tokens_per_step']:.2f} |")
    lines += ["", "Computation paths on this backend: the AR continuation's logits one token at a time vs in blocks "
              "of 4 vs one full forward, in the same dtype (maxima over positions, units of EPSILON * max|logit|). "
              "Zero means bit-identical: MLX's CPU float16 / bfloat16 / quantized kernels compute every row alone, "
              "so a packed verify equals a one-token step there and no flip can occur; float32 goes through MKL, "
              "whose blocking depends on the row count. The rounding against float32 (D) is what a backend whose "
              "kernels do depend on the row count (Metal) can show:", "",
              "| dtype | positions | top-2 move, blocks | top-2 move, full | any logit, blocks | any logit, full | "
              "max abs logit | smallest AR gap | vs float32: positions | D (max) | D (p99) | any logit vs float32 |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        c = s["calibration_max_in_eps_scale"]
        lines.append(f"| {s['dtype']} | {s['calibration_positions']} | {_fmt(c['move_block'], '.2f')} | "
                     f"{_fmt(c['move_full'], '.2f')} | {_fmt(c['max_diff_block'], '.2f')} | "
                     f"{_fmt(c['max_diff_full'], '.2f')} | {_fmt(s['calibration_max_scale'], '.1f')} | "
                     f"{_fmt(s['calibration_min_ar_gap'])} | {s['vs_float32_positions']} | "
                     f"{_fmt(s['vs_float32_max_top2_move'], '.2f')} | {_fmt(s['vs_float32_p99_top2_move'], '.2f')} | "
                     f"{_fmt(s['vs_float32_max_any_logit'], '.2f')} |")
    return "\n".join(lines) + "\n"


def mlx_lm_markdown(rows: list[dict[str, Any]]) -> str:
    """Our model vs mlx-lm's on the same weights."""
    lines = ["", "Our Llama vs `mlx_lm.models.llama.Model` on the same weights (quantized: the GGUF's packed Q4_1 / "
             "Q8_0 arrays, quantized the same way; full 30-layer model, one forward over a short text): max "
             "|difference| in units of EPSILON * max |value| (tests/test_dtypes.py allows MLX_LM_TOLERANCE of "
             "them on a 1-layer cut):", "",
             "| dtype | tokens | hidden: max diff | hidden: in eps*scale | last logits: max diff | "
             "logits: in eps*scale | same argmax |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        h, g = r["hidden"], r["logits"]
        lines.append(f"| {r['dtype']} | {r['tokens']} | {h['max_abs_diff']:.3g} | {h['in_eps_scale']} | "
                     f"{g['max_abs_diff']:.3g} | {g['in_eps_scale']} | {r['same_argmax']} |")
    return "\n".join(lines) + "\n"


def machine_brief() -> dict[str, Any]:
    """`uptime` and the busy processes right now."""
    import subprocess

    from mlx_redrafter.system.machine_state import snapshot

    snap = snapshot(1.0)
    busy = ", ".join(f"{p['name']} (nice {p['nice']}, {p['cpu_percent']:.0f}%)" for p in snap.get("busy") or [])
    up = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    return {"uptime": up, "busy": busy, "loadavg": snap["loadavg"]}


def write_report(out_dir: Path = OUT_DIR) -> dict[str, Any]:
    """Rebuild agreement.json and README.md from every agreement-<dtype>.json in `out_dir`."""
    order = ["float32", "bfloat16", "float16", "quantized"]
    recs = [json.loads(p.read_text()) for p in sorted(out_dir.glob("agreement-*.json"))]
    recs.sort(key=lambda r: order.index(r["dtype"]) if r["dtype"] in order else 9)
    cal32 = {p.stem.split("-", 1)[1]: json.loads(p.read_text()) for p in out_dir.glob("calibration-*.json")}
    summaries = [summarize(r, cal32.get(r["dtype"])) for r in recs]
    machine = machine_brief()
    report = {"machine_now": machine, "tie_factor": TIE_FACTOR, "epsilon": EPSILON, "fp32_tie": FP32_TIE,
              "length": LENGTH, "calibration_block": BLOCK, "summaries": summaries}
    write_atomic(out_dir / "agreement.json", json.dumps(report, indent=2) + "\n")
    mlx_lm = out_dir / "mlx-lm-logits.json"
    if mlx_lm.exists():
        report["mlx_lm"] = json.loads(mlx_lm.read_text())
    write_atomic(out_dir / "README.md", markdown(summaries, machine)
                 + (mlx_lm_markdown(report["mlx_lm"]) if "mlx_lm" in report else ""))
    return report


def run(dtypes: list[str], num_prompts: int, max_tokens: int, quantized_prompts: int, quantized_tokens: int,
        calibrate_prompts: int, calibrate_positions: int, out_dir: Path = OUT_DIR, names: list[str] | None = None,
        log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the given dtypes (quantized: its own smaller budget and the QUANTIZED_RUNS; `names` picks runs), then
    rebuild the report."""
    for dtype in dtypes:
        q = dtype == "quantized"
        pick = names or [r[0] for r in RUNS if not q or r[0] in QUANTIZED_RUNS]
        runs = [r for r in RUNS if r[0] in pick]
        run_dtype(dtype, quantized_prompts if q else num_prompts, quantized_tokens if q else max_tokens,
                  1 if q else calibrate_prompts, min(calibrate_positions, 12) if q else calibrate_positions, runs,
                  out_dir / f"agreement-{dtype}.json", log)
    return write_report(out_dir)
