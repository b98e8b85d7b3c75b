"""A speed A/B of drafters in one process: plain decoding (AR) and, for each drafter, the default mode and the
drafter alone, every configuration on the same prompts, interleaved (the drafters' order rotates per prompt and
round, so drift of the machine's speed spreads over all of them), greedy, float32.

Speed is pooled: total AR time over a configuration's total time on the same prompts, what a user waiting on the
whole workload sees. Prompts: every k-th MT-bench first turn and the first-turn prompts of corpora's held-out
shards (never trained on). Every output is checked against AR's. Results -> OUT/ab.json and OUT/ab.md.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .report import save_report

MODES = ("auto", "rnn")  # the default mode, and the drafter alone


def prompt_sets(lm: Any, per_set: int, heldout: list[Path]) -> dict[str, list[list[int]]]:
    """Prompt ids by set: `per_set` MT-bench first turns (evenly spaced) and `per_set` of each corpus' held-out
    shard."""
    from mlx_redrafter import api
    from mlx_redrafter.prompts import first_turns
    from mlx_redrafter.train.evaluate import heldout_prompt_ids

    rows = first_turns()
    step = max(1, len(rows) // per_set)
    sets = {"mt-bench": [api.encode_prompt(lm, rows[i]["prompt"]) for i in range(0, len(rows), step)][:per_set]}
    for corpus in heldout:
        sets[f"heldout:{Path(corpus).name}"] = heldout_prompt_ids(corpus, per_set)
    return sets


def run_ab(drafters: list[str], rounds: int, per_set: int, heldout: list[Path], max_tokens: int = 128,
           log: Callable[[str], None] = print) -> dict[str, Any]:
    """Decode every prompt with AR and each drafter in each of MODES, `rounds` times; pooled totals per
    configuration (and per prompt set)."""
    from mlx_redrafter import api
    from mlx_redrafter.draft.redrafter import read_features
    from mlx_redrafter.options import DecodeOptions
    from mlx_redrafter.sweep import decode

    lm = api.load(None, drafter="none", dtype="float32")
    models = {"ar": dataclasses.replace(lm, drafter=None, drafter_name="none")}
    for spec in drafters:
        d, name = api.resolve_drafter(spec, lm.target)
        models[spec] = dataclasses.replace(lm, drafter=d, drafter_name=name)
    sets = prompt_sets(lm, per_set, heldout)
    names = list(drafters)
    configs = [("ar", "none")] + [(n, m) for n in names for m in MODES]
    totals: dict[tuple[str, str], dict[str, dict[str, float]]] = {}  # (drafter, mode) -> prompt set -> sums
    same = True

    def run(name: str, mode: str, ids: list[int], where: str) -> list[int]:
        m = models[name]
        read_features(m.target.model, m.drafter)  # the layers this drafter reads (none for AR)
        out, st = decode(m, ids, DecodeOptions(draft=mode, max_tokens=max_tokens))
        for key in ("all", where):
            t = totals.setdefault((name, mode), {}).setdefault(key, {"s": 0.0, "tokens": 0, "calls": 0})
            t["s"] += st.decode_s
            t["tokens"] += len(out) - 1
            t["calls"] += st.steps
        return out

    for name, mode in configs:  # warm-up: first calls compile and fill caches
        run(name, mode, next(iter(sets.values()))[0], "warm-up")
    totals.clear()
    t0 = time.perf_counter()
    for rnd in range(rounds):
        k = 0
        for where, prompts in sets.items():
            for ids in prompts:
                ref = run("ar", "none", ids, where)
                order = names[(k + rnd) % len(names):] + names[: (k + rnd) % len(names)]
                for name in order:
                    for mode in MODES:
                        same &= run(name, mode, ids, where) == ref
                k += 1
        log(f"round {rnd + 1}/{rounds} done ({time.perf_counter() - t0:.0f} s)")
    ar = totals[("ar", "none")]
    rows = []
    for (name, mode), t in totals.items():
        for where, v in t.items():
            rows.append({"drafter": name, "mode": mode, "set": where, "tokens": v["tokens"],
                         "seconds": round(v["s"], 3), "tokens_per_s": round(v["tokens"] / v["s"], 2),
                         "tokens_per_call": round(v["tokens"] / v["calls"], 4),
                         "speed_vs_ar": round(ar[where]["s"] / v["s"], 4)})
    return {"drafters": drafters, "rounds": rounds, "per_set": per_set, "sets": {k: len(v) for k, v in sets.items()},
            "max_tokens": max_tokens, "identical_to_ar": same, "rows": rows}


def markdown(report: dict[str, Any]) -> str:
    """The report's table: per configuration and prompt set, pooled."""
    lines = [f"# Drafter A/B ({report['rounds']} rounds, {report['max_tokens']} tokens, sets "
             f"{', '.join(f'{k} ({v})' for k, v in report['sets'].items())})", "",
             f"Every output identical to AR: {report['identical_to_ar']}", "",
             "| drafter | mode | set | tokens/s | tokens/call | x AR (pooled) |", "|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(f"| {r['drafter']} | {r['mode']} | {r['set']} | {r['tokens_per_s']} | {r['tokens_per_call']} | "
                     f"{r['speed_vs_ar']} |")
    return "\n".join(lines) + "\n"


def write_ab(out: Path, report: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    save_report(out, "ab", report, markdown)
