"""Drafter recipe ablations: train variants on one corpus with one budget, measure them on one held-out slice.

Every variant is a set of `TrainConfig` overrides (plus how much of the corpus it may use). Each trains in
its own run directory (resumable; finished variants are skipped) and is measured twice on the corpus'
held-out prompts (never trained on): teacher-forced top-1 accuracy per draft step, and tokens per target
call when it actually decodes (greedy, float32). Results go to OUT/drafter-ablation.{json,md}, updated after
every variant.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from mlx_redrafter.files import write_atomic

# name -> (TrainConfig overrides, corpus response tokens or None for all)
VARIANTS: dict[str, tuple[dict[str, Any], int | None]] = {
    "base": ({}, None),
    "soft-labels": ({"labels": "soft"}, None),
    "exit-1152": ({"exit_dim": 1152}, None),
    "layers-1": ({"num_draft_layers": 1}, None),
    "layers-4": ({"num_draft_layers": 4}, None),
    "vocab-4096": ({"draft_vocab_size": 4096}, None),
    "vocab-16384": ({"draft_vocab_size": 16384}, None),
    "T-3": ({"draft_len": 3}, None),
    "T-8": ({"draft_len": 8}, None),
    "dropout-0.2": ({"input_dropout": 0.2}, None),
    "steps-2000": ({"steps": 2000}, None),  # twice the budget (~1.6 epochs of the 0.32M corpus)
    "random-head-init": ({"init_from_target": False}, None),
    "corpus-0.15M": ({}, 150_000),
    "corpus-0.5M": ({}, 500_000),
    "corpus-1M": ({}, 1_000_000),
    "corpus-2M": ({}, 2_000_000),
    # the seed papers' other drafters, same corpus and budget (decoded with their own draft mode)
    "kind-medusa": ({"kind": "medusa"}, None),
    "kind-semi_ar_transformer": ({"kind": "semi_ar_transformer"}, None),
    "kind-semi_ar_lstm": ({"kind": "semi_ar_lstm"}, None),
}


def run_ablation(names: list[str], corpus_root: Path, features_root: Path, runs_root: Path, out_dir: Path,
                 base: dict[str, Any], eval_prompts: int, eval_tokens: int, shapes: list[tuple[int, int]],
                 log=print) -> dict[str, Any]:
    """Train and measure the named variants; returns (and writes) all results so far."""
    from mlx_redrafter.models.loader import load_target
    from mlx_redrafter.system.machine import machine_info
    from mlx_redrafter.system.machine_state import loadavg
    from mlx_redrafter.train.evaluate import heldout_prompt_ids, run_eval
    from mlx_redrafter.train.kinds import DRAFT_MODE
    from mlx_redrafter.train.loop import TrainConfig, train_drafter
    from mlx_redrafter.train.pipeline import prepare, save_shipped

    out_json = out_dir / "drafter-ablation.json"
    results: dict[str, Any] = json.loads(out_json.read_text()) if out_json.exists() else {"variants": {}}
    target = load_target(None, "float32")
    prompts = heldout_prompt_ids(corpus_root, eval_prompts)
    for name in names:
        overrides, max_tokens = VARIANTS[name]
        cfg = replace(TrainConfig(), **{**base, **overrides})
        key = json.dumps({"cfg": asdict(cfg), "corpus_tokens": max_tokens}, sort_keys=True)
        if results["variants"].get(name, {}).get("key") == key:
            log(f"{name}: done already")
            continue
        log(f"{name}: {overrides} corpus {max_tokens or 'all'}")
        run = runs_root / name
        if (run / "variant.json").exists() and (run / "variant.json").read_text() != key:
            shutil.rmtree(run)  # another recipe under this name: start over (same key: resume)
        write_atomic(run / "variant.json", key)
        t0 = time.perf_counter()
        tr, ho, used = prepare(target, corpus_root, features_root, max_tokens, log=log)
        drafter, summary = train_drafter(target, tr, ho, run, cfg, log=log)
        save_shipped(drafter, run / "final", "")
        mode = DRAFT_MODE[cfg.kind]
        cell_shapes = shapes if mode != "medusa" else sorted({(1, L) for _, L in shapes})  # Medusa: tree, no W
        ev = run_eval(str(run / "final"), None, sorted({w for w, _ in cell_shapes}),
                      sorted({L for _, L in cell_shapes}), prompts, eval_tokens, "the corpus' held-out shard",
                      draft=mode, log=None)
        cells = {f"W{r['W']}L{r['L']}": r["tokens_per_step"] for r in ev["results"]
                 if (r["W"], r["L"]) in cell_shapes}
        results["variants"][name] = {
            "key": key, "overrides": overrides, "kind": cfg.kind, "draft": mode,
            "corpus_tokens": used["train_response_tokens"],
            "train_sequences": used["train_sequences"], "params": summary["params"],
            "steps": cfg.steps, "positions_seen": cfg.steps * cfg.batch_size,
            "train_s": summary["train_time_s"], "heldout_loss": summary["final"]["val_loss"],
            "heldout_top1": summary["final"]["acc"], "tokens_per_call": cells,
            "loadavg": loadavg(), "seconds": round(time.perf_counter() - t0, 1),
        }
        del drafter
        done = results["variants"][name]
        if out_json.exists():  # another ablation process may have written variants meanwhile: keep them
            results = json.loads(out_json.read_text())
            results.setdefault("variants", {})[name] = done
        results["machine"] = machine_info()
        results["settings"] = {"base": asdict(replace(TrainConfig(), **base)), "eval_prompts": len(prompts),
                               "eval_tokens": eval_tokens, "shapes": shapes}
        write_atomic(out_json, json.dumps(results, indent=1) + "\n")
        write_atomic(out_dir / "drafter-ablation.md", markdown(results))
        plot_learning_curve(results, out_dir / "drafter-learning-curve.png")
    return results


def markdown(results: dict[str, Any]) -> str:
    """The ablation table."""
    rows = results["variants"]
    shapes = sorted({k for r in rows.values() for k in r["tokens_per_call"]})
    s = results.get("settings", {})
    lines = ["# Drafter recipe ablation", "",
             f"Held-out: {s.get('eval_prompts')} prompts of the corpus' held-out shard (never trained on), "
             f"{s.get('eval_tokens')} new tokens, greedy, float32. Teacher-forced top-1 per draft step on the same "
             "shard's sequences.", "",
             "| variant | corpus tokens | params | steps | train s | held-out loss | top-1 step 1..3 | "
             + " | ".join(f"tokens/call {k}" for k in shapes) + " |",
             "|---" * (7 + len(shapes)) + "|"]
    for name, r in rows.items():
        top = ", ".join(f"{a:.3f}" for a in r["heldout_top1"][:3])
        lines.append(f"| {name} | {r['corpus_tokens']:,} | {r['params'] / 1e6:.2f}M | {r['steps']} "
                     f"| {r['train_s']:.0f} | {r['heldout_loss']:.3f} | {top} | "
                     + " | ".join(f"{r['tokens_per_call'].get(k, float('nan')):.3f}" for k in shapes) + " |")
    curve = learning_curve(results)
    if len(curve) > 1:
        lines += ["", "Learning curve (the base recipe at growing corpus sizes, same steps; "
                      "[plot](drafter-learning-curve.png)):", "",
                  "| corpus tokens | held-out loss | top-1 step 1 | " + " | ".join(f"tokens/call {k}" for k in shapes)
                  + " |", "|---" * (3 + len(shapes)) + "|"]
        for r in curve:
            lines.append(f"| {r['corpus_tokens']:,} | {r['heldout_loss']:.3f} | {r['heldout_top1'][0]:.3f} | "
                         + " | ".join(f"{r['tokens_per_call'].get(k, float('nan')):.3f}" for k in shapes) + " |")
    return "\n".join(lines) + "\n"


def learning_curve(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The base recipe's variants (no overrides) by corpus size."""
    rows = [r for r in results["variants"].values() if not r["overrides"]]
    return sorted(rows, key=lambda r: r["corpus_tokens"])


def plot_learning_curve(results: dict[str, Any], path: Path) -> str | None:
    """Tokens per target call vs corpus size (log x), one line per cell shape; None with fewer than 2 sizes."""
    curve = learning_curve(results)
    if len(curve) < 2:
        return None
    from .plots import _save, plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for k in sorted({k for r in curve for k in r["tokens_per_call"]}):
        ax.plot([r["corpus_tokens"] for r in curve], [r["tokens_per_call"].get(k) for r in curve], "o-", label=k)
    ax.set_xscale("log")
    ax.set(xlabel="distilled response tokens (training)", ylabel="tokens per target call (held-out)",
           title="ReDrafter learning curve")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)
