"""`redrafter-mlx bench`: run the sweep, write CSV + JSON + PNG plots + README.md under bench/results/<DEVICE>/."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from mlx_redrafter.errors import UserError

from .harness import (
    COLUMNS,
    Prompt,
    SweepSpec,
    best_cells,
    default_prompts_file,
    read_prompts,
    summarize,
    sweep,
)

RESULTS_DIR = Path(__file__).resolve().parent / "results"
QUICK = {"num_prompts": 3, "max_tokens": 64, "widths": [1, 4], "lengths": [3, 5], "repeats": 1}


def write_text_atomic(path: Path, text: str) -> None:
    """Write text via a temp file in the same directory and rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; results are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _fmt(v: Any) -> Any:
    return f"{v:.6g}" if isinstance(v, float) else v


def rows_csv(rows: list[dict]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COLUMNS, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: _fmt(r.get(k, "")) for k in COLUMNS})
    return buf.getvalue()


def check_label(label: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", label or ""):
        raise UserError(f"--device {label!r}: use letters, digits, '.', '_' or '-' (it names a results folder)")
    return label


def profile_cell(spec: SweepSpec, prompt: Prompt, dtype: str, W: int, L: int, max_tokens: int) -> dict[str, Any]:
    """One generation under a timing ledger (each timed function evaluated at its boundary); returns the ledger."""
    from mlx_redrafter import api, decode
    from mlx_redrafter.cache import KVCache
    from mlx_redrafter.drafter import Drafter
    from mlx_redrafter.ledger import Ledger, instrument
    from mlx_redrafter.model import Model

    runner = api.load(spec.model, spec.drafter, dtype)
    ids = api.encode_prompt(runner, prompt.text)
    fns = [f for f in ("prefill", "beam_search", "pack", "verify_mask", "accept_greedy", "truncate_at_eos")
           if callable(getattr(decode, f, None))]
    targets: dict[Any, Any] = {decode: fns, Model: {"__call__": "Model.forward"}}
    if "commit" in KVCache.__dict__:
        targets[KVCache] = ["commit"]
    drafter_fns = [f for f in ("next_state", "logits") if f in Drafter.__dict__]
    if drafter_fns:
        targets[Drafter] = drafter_fns
    api.generate(runner, ids, max_tokens=min(16, max_tokens), beam_width=W, beam_length=L)  # warm-up
    with instrument(targets), Ledger() as led:
        res = api.generate(runner, ids, max_tokens=max_tokens, beam_width=W, beam_length=L)
    return {"dtype": runner.target.dtype, "beam_width": W, "beam_length": L, "prompt_id": prompt.id,
            "generated_tokens": res.stats.generated_tokens, "steps": res.stats.steps, **led.as_dict(),
            "table": led.table()}


def readme(meta: dict, summary: list[dict], best: dict[str, dict], files: dict[str, str]) -> str:
    m = meta["machine"]
    lines = [
        f"# Benchmark results: {meta['device']}",
        "",
        f"Latest run `{meta['run_id']}`: model `{meta['model_name']}`, drafter `{meta['settings']['drafter']}`, "
        f"{meta['settings']['num_prompts']} MT-bench first turns, max {meta['settings']['max_tokens']} new tokens, "
        f"greedy, {meta['settings']['repeats']} repeat(s), W in {meta['settings']['widths']}, "
        f"L in {meta['settings']['lengths']}.",
        "",
        f"Machine: {m['cpu']} ({m['cpu_cores']} cores, {m['memory_gb']} GB, {m.get('cpu_features') or '-'}), "
        f"{m['os_pretty']}, "
        f"MLX {m['mlx']} ({m['backend']}, {m['default_device']}), mlx-lm {m['mlx_lm']}, BLAS {m['blas']}, "
        f"Python {m['python']}.",
        "",
        "Best cell per dtype (speedup = mean over prompts of decode tok/s over our AR decode tok/s on the "
        "same prompt; prefill excluded):",
        "",
        "| dtype | W | L | tokens/step | decode tok/s | our AR tok/s | mlx-lm tok/s | vs AR | vs mlx-lm "
        "| output = AR |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for dtype, b in sorted(best.items()):
        lines.append(
            f"| {dtype} | {b['beam_width']} | {b['beam_length']} | {b['tokens_per_step']:.2f} | "
            f"{b['decode_tokens_per_s']:.1f} | {b['ar_decode_tokens_per_s']:.1f} | "
            f"{b['mlx_lm_decode_tokens_per_s']:.1f} | {b['speedup_vs_ar']:.2f}x | {b['speedup_vs_mlx_lm']:.2f}x | "
            f"{100 * b['match_ar']:.0f}% |")
    ref = [s for s in summary if s["method"] == "mlx_lm"]
    for s in ref:
        lines.append("")
        lines.append(f"mlx-lm greedy ids vs ours ({s['dtype']}): {100 * s['match_ar']:.1f}% identical "
                     f"(common prefix / length, mean over prompts).")
    lines += ["", "Files: " + ", ".join(f"[{k}]({v})" for k, v in files.items()), ""]
    if meta.get("profile"):
        p = meta["profile"]
        lines += [f"Timing ledger, {p['dtype']} W={p['beam_width']} L={p['beam_length']}, prompt {p['prompt_id']} "
                  f"(functions evaluated at their boundary, so the total runs a little slower than the sweep):",
                  "", "```", p["table"], "```", ""]
    return "\n".join(lines)


def run_bench(device: str, spec: SweepSpec, prompts_file: Path | None, num_prompts: int | None,
              out_root: Path = RESULTS_DIR, profile: bool = True, progress: bool = True) -> dict[str, Any]:
    """Run the sweep and write everything; returns {"dir", "files", "best", "summary"}."""
    from mlx_redrafter.machine import machine_info

    check_label(device)
    spec.device = device
    spec.check()
    prompts = read_prompts(prompts_file, num_prompts)
    out = out_root / device  # created by the first write (a run that fails early leaves no empty folder)
    run_id = time.strftime("%Y%m%d-%H%M%S")
    csv_path, json_path = out / f"bench-{run_id}.csv", out / f"bench-{run_id}.json"
    meta: dict[str, Any] = {
        "device": device, "run_id": run_id, "machine": machine_info(),
        "settings": {**asdict(spec), "model": spec.model or "default", "num_prompts": len(prompts),
                     "prompts_file": str(prompts_file or default_prompts_file()),
                     "prompts": [{"id": p.id, "category": p.category} for p in prompts]},
        "speedup_definition": "mean over prompts of (decode tokens/s) / (our AR decode tokens/s, same prompt); "
                              "decode excludes prefill; decode tokens = generated - 1",
    }
    started = time.perf_counter()

    def save(rows: list[dict]) -> None:
        write_text_atomic(csv_path, rows_csv(rows))

    rows = sweep(spec, prompts, on_rows=save, progress=progress)
    save(rows)
    summary = summarize(rows)
    best = best_cells(summary)
    meta["elapsed_s"] = round(time.perf_counter() - started, 1)
    meta["resolved_dtypes"] = sorted({r["dtype"] for r in rows})
    meta["model_name"] = rows[0]["model"] if rows else ""
    meta["drafter_name"] = next((r["drafter"] for r in rows if r["method"] == "redrafter"), "")
    meta["summary"] = summary
    meta["best"] = best
    if profile and best:
        dtype, b = max(best.items(), key=lambda kv: kv[1]["decode_tokens_per_s"])
        meta["profile"] = profile_cell(spec, prompts[0], dtype, b["beam_width"], b["beam_length"],
                                       min(spec.max_tokens, 64))
    from . import plots

    files = {"csv": csv_path.name, "json": json_path.name,
             **plots.plot_all(summary, plots.plot_title(meta), out, f"bench-{run_id}")}
    meta["files"] = files
    write_text_atomic(json_path, json.dumps(meta, indent=2, default=str) + "\n")
    write_text_atomic(out / "README.md", readme(meta, summary, best, files))
    return {"dir": out, "files": files, "best": best, "summary": summary, "meta": meta}
