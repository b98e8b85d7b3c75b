"""Batched decoding benchmark: the cost curve of batched target calls, and throughput per batch size of our
batched speculative decoding, our batched plain decoding and mlx-lm's `batch_generate`, on the same prompts.

Throughput is pooled: all tokens of all prompts over the wall time of the whole batch job (prefills included),
for each system at each batch size; systems run interleaved, repeat by repeat. Every row's greedy ids are
compared with the prompt decoded alone (our plain AR, one at a time).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlx_redrafter import api
from mlx_redrafter.batch.budget import CostCurve
from mlx_redrafter.generate import collect, generate_ar


def curve_markdown(curve: CostCurve) -> str:
    base = curve.seconds[min(curve.seconds)][0]
    P = max(len(v) for v in curve.seconds.values())
    lines = [f"Cost of one batched target call, relative to one row of one token ({base * 1e3:.1f} ms), "
             f"{curve.context} committed tokens per row.", "",
             "| rows B | " + " | ".join(f"P={p}" for p in range(1, P + 1)) + " |",
             "|---|" + "---|" * P]
    for b in sorted(curve.seconds):
        lines.append(f"| {b} | " + " | ".join(f"{s / base:.2f}" for s in curve.seconds[b]) + " |")
    return "\n".join(lines) + "\n"


def _mlx_lm_batch(ref, eos: list[int], prompts: list[list[int]], batch: int, max_tokens: int) -> list[list[int]]:
    from mlx_lm.generate import batch_generate

    from mlx_redrafter.system.blas import small_gemm_disabled

    class _Tok:  # what batch_generate reads of a tokenizer
        eos_token_ids = eos

        @staticmethod
        def decode(ids: list[int]) -> str:
            return ""

    with small_gemm_disabled():  # on our stream: a stream of its own runs on a second thread, whose idle BLAS
        # threads then compete with ours for the cores and slow every later run in this process (measured: our
        # batched decoding at B = 2 went from 44 to 26 tokens/s after one batch_generate on its own stream)
        out = batch_generate(ref, _Tok(), prompts, max_tokens=max_tokens, return_token_ids=True,
                             completion_batch_size=batch, prefill_batch_size=batch,
                             stream=mx.default_stream(mx.default_device()))
    return out.token_ids


def run(lm: api.LoadedModel, prompts: list[list[int]], batches: list[int], max_tokens: int, repeats: int,
        mlx_lm: bool, curve: CostCurve | None, draft: str = "auto", log=print) -> dict[str, Any]:
    """Every system at every batch size, interleaved per repeat; see the module docstring."""
    model, eos = lm.target.model, lm.tokenizer.eos_ids
    alone = [collect(generate_ar(model, p, max_tokens=max_tokens, eos_ids=eos))[0] for p in prompts]
    spec = api.decode_options(draft=draft, max_tokens=max_tokens)
    plain = api.decode_options(draft="none", max_tokens=max_tokens)
    ref = None
    if mlx_lm:
        from .mlx_lm_ref import mlx_lm_model

        ref = mlx_lm_model(model)
    systems = {
        "speculative": lambda b: api.generate_batch(lm, prompts, spec, batch_size=b, curve=curve),
        "plain": lambda b: api.generate_batch(lm, prompts, plain, batch_size=b),
    }
    if ref is not None:
        systems["mlx-lm"] = lambda b: _mlx_lm_batch(ref, eos, prompts, b, max_tokens)
    rows = []
    for b in batches:
        times: dict[str, list[float]] = {k: [] for k in systems}
        outs: dict[str, Any] = {}
        for _ in range(repeats):
            for name, fn in systems.items():
                mx.clear_cache()
                t = time.perf_counter()
                outs[name] = fn(b)
                times[name].append(time.perf_counter() - t)
        for name, out in outs.items():
            ids = [r.tokens for r in out] if name != "mlx-lm" else [list(x) for x in out]
            tokens = sum(len(x) for x in ids)
            row = {"batch": b, "system": name, "seconds": statistics.median(times[name]), "all_seconds": times[name],
                   "tokens": tokens, "ids_equal_alone": sum(x == y for x, y in zip(ids, alone)), "prompts": len(ids)}
            row["tokens_per_s"] = tokens / row["seconds"]
            if name != "mlx-lm":
                steps = sum(r.stats.steps for r in out)
                row["tokens_per_row_call"] = (tokens - len(ids)) / steps if steps else 0.0
            rows.append(row)
            log(f"B={b} {name}: {row['tokens_per_s']:.1f} tok/s, {row['ids_equal_alone']}/{len(ids)} ids equal")
    return {"rows": rows, "max_tokens": max_tokens, "repeats": repeats, "draft": draft,
            "prompts": len(prompts), "curve": None if curve is None else curve.to_dict()}


def markdown(res: dict[str, Any], title: str) -> str:
    by = {(r["batch"], r["system"]): r for r in res["rows"]}
    batches = sorted({r["batch"] for r in res["rows"]})
    lines = [f"# {title}", "", f"{res['prompts']} prompts, {res['max_tokens']} new tokens each, greedy float32, "
             f"draft={res['draft']}, median of {res['repeats']} interleaved repeats. Throughput = all tokens / wall "
             "time of the whole job (prefills included).", "",
             "| B | speculative tok/s | tokens per row and call | plain (our batched AR) tok/s | mlx-lm "
             "batch_generate tok/s | speculative / plain | ids = alone (spec, plain, mlx-lm) |",
             "|---|---|---|---|---|---|---|"]
    for b in batches:
        s, p, m = by.get((b, "speculative")), by.get((b, "plain")), by.get((b, "mlx-lm"))
        ratio = s["tokens_per_s"] / p["tokens_per_s"] if s and p else float("nan")
        mlx = (f"{m['tokens_per_s']:.1f}", f"{m['ids_equal_alone']}/{m['prompts']}") if m else ("-", "-")
        lines.append(f"| {b} | {s['tokens_per_s']:.1f} | {s['tokens_per_row_call']:.2f} | {p['tokens_per_s']:.1f} | "
                     f"{mlx[0]} | **{ratio:.2f}x** | {s['ids_equal_alone']}/{s['prompts']}, "
                     f"{p['ids_equal_alone']}/{p['prompts']}, {mlx[1]} |")
    return "\n".join(lines) + "\n"


def write(res: dict[str, Any], out: Path, stem: str, title: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / f"{stem}.md").write_text(markdown(res, title))
