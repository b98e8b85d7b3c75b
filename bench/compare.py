"""One table comparing the drafters on one target: ReDrafter, Medusa, semi-AR (both variants), lookup and
rnn+lookup, each at its best greedy cell, from the sweeps already committed under bench/results/<DEVICE>/.

Sources: the main sweep (`bench-*.json` in the device folder: rnn, lookup, rnn+lookup with the shipped drafter),
one sweep per trained kind (`kind-<kind>/bench-*.json`, run with `--drafter runs/ablation/kind-<kind>/final`),
and the drafter ablation (`drafter-ablation.json`: parameters, training time, held-out top-1; every kind trained
on the same corpus, steps and batch). Speed vs AR is always taken within one sweep (AR interleaved per prompt).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mlx_redrafter.sweep import best_cells, cell_width

from .report import save_report

# row -> (ablation variant, folder of its sweep relative to the device folder, draft mode). The trained kinds
# (same corpus, same budget) each have a sweep of their own; the shipped drafter and lookup come from the main one.
KINDS = {
    "lookup (no training)": (None, ".", "lookup"),
    "redrafter (shipped)": (None, ".", "rnn"),
    "redrafter (shipped) + lookup": (None, ".", "rnn+lookup"),
    "redrafter": ("base", "kind-redrafter", "rnn"),
    "redrafter + lookup": ("base", "kind-redrafter", "rnn+lookup"),
    "medusa": ("kind-medusa", "kind-medusa", "medusa"),
    "semi-AR transformer": ("kind-semi_ar_transformer", "kind-semi_ar_transformer", "semi_ar"),
    "semi-AR LSTM": ("kind-semi_ar_lstm", "kind-semi_ar_lstm", "semi_ar"),
}


def latest_sweep(folder: Path) -> dict[str, Any] | None:
    """The newest `bench-*.json` of a results folder (run ids sort by time), or None."""
    runs = sorted(folder.glob("bench-*.json"))
    return json.loads(runs[-1].read_text()) if runs else None


def compare(device_dir: Path) -> dict[str, Any]:
    """Best greedy float32 cell per drafter kind, with its training facts."""
    ablation_path = device_dir / "drafter-ablation.json"
    ablation = json.loads(ablation_path.read_text())["variants"] if ablation_path.exists() else {}
    rows, sources = [], {}
    for name, (variant, folder, draft) in KINDS.items():
        sweep = latest_sweep(device_dir / folder)
        if sweep is None:
            continue
        cells = best_cells([s for s in sweep["summary"] if s["temperature"] == 0 and s["dtype"] == "float32"])
        cell = cells.get((draft, "float32", 0, "greedy"))
        if cell is None:
            continue
        trained = ablation.get(variant, {}) if variant else {}
        sources[name] = f"{folder}/bench-{sweep['run_id']}.json"
        rows.append({
            "drafter": name, "draft": draft, "params": trained.get("params", 0),
            "train_s": trained.get("train_s", 0.0), "heldout_top1": (trained.get("heldout_top1") or [None])[0],
            "width": cell_width(cell), "beam_length": cell["beam_length"],
            "tokens_per_step": cell["tokens_per_step"], "decode_tokens_per_s": cell["decode_tokens_per_s"],
            "ar_decode_tokens_per_s": cell["ar_decode_tokens_per_s"], "speedup_vs_ar": cell["speedup_vs_ar"],
            "equal_ar": cell["equal_ar"], "run_id": sweep["run_id"],
            "quiet": all(s["quiet"] for s in sweep.get("machine_state", [])),
            "loadavg_before_after": [(s["before"]["loadavg"][0], s["after"]["loadavg"][0])
                                     for s in sweep.get("machine_state", [])],
            "prompts": sweep["settings"]["num_prompts"], "max_tokens": sweep["settings"]["max_tokens"],
        })
    return {"device": device_dir.name, "rows": rows, "sources": sources}


def markdown(report: dict[str, Any]) -> str:
    """The comparison table."""
    lines = [f"# Drafters compared on one target ({report['device']})", "",
             "Each drafter at its best greedy float32 cell (highest pooled speedup over AR: AR's time for the same "
             "tokens over the cell's, over all prompts; AR interleaved per prompt in the same sweep). The rows "
             "without '(shipped)' share one corpus, one held-out slice and one budget (1000 steps x 256 positions "
             "x 5 draft steps); '(shipped)' is the drafter in the package (see its model card); width = W (beams) "
             "for ReDrafter and semi-AR, candidates for lookup, tree nodes for Medusa.", "",
             "| drafter | params | train s | held-out top-1 (step 1) | width | L | tokens/call | tok/s | AR tok/s "
             "| vs AR | ids = AR | machine |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        top1 = f"{r['heldout_top1']:.3f}" if r["heldout_top1"] is not None else "-"
        untrained = r["draft"] == "lookup"
        params = f"{r['params'] / 1e6:.2f}M" if r["params"] else ("0" if untrained else "-")
        train = f"{r['train_s']:.0f}" if r["train_s"] else ("0" if untrained else "-")
        state = "quiet" if r["quiet"] else "NOT quiet"
        lines.append(f"| {r['drafter']} | {params} | {train} | {top1} | {r['width']} | {r['beam_length']} "
                     f"| {r['tokens_per_step']:.2f} | {r['decode_tokens_per_s']:.1f} "
                     f"| {r['ar_decode_tokens_per_s']:.1f} | {r['speedup_vs_ar']:.2f}x | {100 * r['equal_ar']:.0f}% "
                     f"| {state} |")
    lines += ["", "Absolute tokens/s differ between sweeps (AR ran at 16.2 tok/s in the main sweep, which also loads "
              "mlx-lm's copy of the model, and at 22-25 tok/s in the per-kind sweeps without it): compare the ratios "
              "within a row, and treat ratios across sweeps with that in mind.", "",
              "Sources: " + ", ".join(f"{k}: `{v}`" for k, v in report["sources"].items()), ""]
    return "\n".join(lines)


def write_comparison(device_dir: Path) -> dict[str, Any]:
    """Write DEVICE_DIR/drafter-comparison.{json,md}; returns the report."""
    report = compare(device_dir)
    save_report(device_dir, "drafter-comparison", report, markdown)
    return report
