"""`redrafter-mlx tune`: a short sweep, then store the fastest (W, L, dtype) -- or plain AR -- for this machine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .harness import SweepSpec, best_cells, read_prompts, summarize, sweep

# Speculation can only win when a target call decides more than one token: a cell below this many tokens per
# step does strictly more work per token than AR, so a measured "speedup" there is timing noise.
MIN_TOKENS_PER_STEP = 1.1


def decide(summary: list[dict[str, Any]], min_speedup: float) -> dict[str, Any]:
    """The tuned entry: the fastest dtype's best cell if it beats that dtype's AR by `min_speedup` (and decides
    at least MIN_TOKENS_PER_STEP tokens per target call), else AR."""
    eligible = [s for s in summary if s["method"] != "redrafter" or s["tokens_per_step"] >= MIN_TOKENS_PER_STEP]
    best = best_cells(eligible)
    fallback = best_cells(summary)
    options = []
    for s in summary:
        if s["method"] != "ar":
            continue
        cell = best.get(s["dtype"])
        if cell is not None and cell["speedup_vs_ar"] >= min_speedup:
            options.append({"decision": "redrafter", "dtype": s["dtype"], "beam_width": cell["beam_width"],
                            "beam_length": cell["beam_length"], "speedup_vs_ar": cell["speedup_vs_ar"],
                            "decode_tokens_per_s": cell["decode_tokens_per_s"],
                            "tokens_per_step": cell["tokens_per_step"], "ar_decode_tokens_per_s":
                                s["decode_tokens_per_s"], "match_ar": cell["match_ar"]})
        else:
            options.append({"decision": "ar", "dtype": s["dtype"], "beam_width": 0, "beam_length": 0,
                            "speedup_vs_ar": 1.0, "decode_tokens_per_s": s["decode_tokens_per_s"],
                            "ar_decode_tokens_per_s": s["decode_tokens_per_s"],
                            "best_cell": _brief(cell or fallback.get(s["dtype"]))})
    return max(options, key=lambda o: o["decode_tokens_per_s"])


def run_tune(spec: SweepSpec, prompts_file: Path | None, num_prompts: int, min_speedup: float = 1.03,
             progress: bool = True) -> tuple[dict[str, Any], Path]:
    """Sweep, decide and store; returns (entry, tuned file path)."""
    from mlx_redrafter import tuning

    spec.check()
    prompts = read_prompts(prompts_file, num_prompts)
    rows = sweep(spec, prompts, progress=progress)
    summary = summarize(rows)
    entry = decide(summary, min_speedup)
    entry["settings"] = {"widths": spec.widths, "lengths": spec.lengths, "dtypes": sorted({r["dtype"] for r in rows}),
                         "num_prompts": len(prompts), "max_tokens": spec.max_tokens, "min_speedup": min_speedup}
    entry["cells"] = [{k: s[k] for k in ("dtype", "beam_width", "beam_length", "speedup_vs_ar", "tokens_per_step")}
                      for s in summary if s["method"] == "redrafter"]
    path = tuning.store(spec.model, spec.drafter, entry)
    return entry, path


def _brief(cell: dict[str, Any] | None) -> dict[str, Any] | None:
    if cell is None:
        return None
    return {k: cell[k] for k in ("beam_width", "beam_length", "speedup_vs_ar", "tokens_per_step")}
