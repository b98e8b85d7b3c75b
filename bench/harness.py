"""Benchmark sweep: ReDrafter over a W x L (x dtype) grid vs our AR path and mlx-lm's AR, on MT-bench prompts.

One row per (prompt, config). Every measured generation is greedy. Configs are interleaved per prompt and
repeat (AR, mlx-lm, each cell, then the next repeat), so slow drifts of a shared machine hit all alike; with
several repeats a row keeps the median decode time. Speedups are per prompt: the cell's decode tokens/s over
the AR decode tokens/s on the same prompt and dtype (prefill excluded, as in Apple's analysis).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlx_redrafter.errors import UserError
from mlx_redrafter.prompts import read_prompts as read_prompt_file

ROOT = Path(__file__).resolve().parents[1]
SHARED_MT_BENCH = ROOT.parent / "shared" / "data" / "mt_bench.jsonl"
REPO_MT_BENCH = ROOT / "data" / "mt_bench.jsonl"

COLUMNS = [
    "device", "model", "drafter", "dtype", "method", "beam_width", "beam_length", "temperature",
    "prompt_id", "category", "prompt_tokens", "generated_tokens", "steps", "tokens_per_step",
    "verified_tokens", "candidate_tokens", "prefill_s", "decode_s", "decode_tokens_per_s",
    "ar_decode_tokens_per_s", "mlx_lm_decode_tokens_per_s", "speedup_vs_ar", "speedup_vs_mlx_lm",
    "draft_s", "verify_s", "accept_s", "peak_memory_gb", "match_ar", "stop_reason", "repeats", "decode_s_runs",
]


@dataclass
class Prompt:
    id: str
    text: str
    category: str = ""


@dataclass
class SweepSpec:
    """What to measure (shared by `bench` and `tune`)."""

    model: str | None = None
    drafter: str = "default"
    dtypes: list[str] = field(default_factory=lambda: ["auto"])
    widths: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 8])
    lengths: list[int] = field(default_factory=lambda: [2, 3, 4, 5, 6])
    max_tokens: int = 128
    repeats: int = 1
    warmup_tokens: int = 16
    mlx_lm: bool = True
    device: str = "local"

    def check(self) -> None:
        if not self.widths or min(self.widths) < 1:
            raise UserError(f"beam widths must be >= 1 (got {self.widths})")
        if not self.lengths or min(self.lengths) < 2:
            raise UserError(f"beam lengths must be >= 2 (got {self.lengths})")
        if self.max_tokens < 2:
            raise UserError(f"--max-tokens must be >= 2 (got {self.max_tokens})")
        if self.repeats < 1:
            raise UserError(f"--repeats must be >= 1 (got {self.repeats})")


def default_prompts_file() -> Path:
    """The shared MT-bench copy when present, else the one shipped in the repo."""
    return SHARED_MT_BENCH if SHARED_MT_BENCH.exists() else REPO_MT_BENCH


def read_prompts(path: Path | None, num: int | None) -> list[Prompt]:
    """First turns of MT-bench-style JSONL ({"turns": [...]}) or {"prompt": ...} lines; `num` spread evenly."""
    path = path or default_prompts_file()
    prompts = [
        Prompt(id=str(r.get("question_id", r.get("id", i))), text=r["prompt"], category=str(r.get("category", "")))
        for i, r in enumerate(read_prompt_file(path), 1)
    ]
    if num is not None:
        if num < 1:
            raise UserError(f"--num-prompts must be >= 1 (got {num})")
        if num < len(prompts):  # spread over the file (MT-bench is grouped by category)
            prompts = [prompts[(k * len(prompts)) // num] for k in range(num)]
    return prompts


def _common_prefix_fraction(ref: list[int], other: list[int]) -> float:
    n = 0
    for a, b in zip(ref, other):
        if a != b:
            break
        n += 1
    longest = max(len(ref), len(other))
    return n / longest if longest else 1.0


def _run_ours(runner: Any, ids: list[int], max_tokens: int, W: int, L: int, draft: bool) -> tuple[list[int], Any]:
    from mlx_redrafter.decode import Stats, generate_tokens

    stats = Stats()
    toks: list[int] = []
    for new in generate_tokens(runner.target.model, ids, drafter=runner.drafter if draft else None,
                               beam_width=W, beam_length=L, max_tokens=max_tokens,
                               eos_ids=runner.tokenizer.eos_ids, stats=stats):
        toks.extend(new)
    return toks, stats


@dataclass
class Measured:
    """Repeats of one (prompt, config): tokens and stats of the median-time run plus all decode times."""

    tokens: list[int]
    stats: Any
    decode_runs: list[float]


def _keep_median(runs: list[tuple[list[int], Any, float]]) -> Measured:
    times = [r[2] for r in runs]
    med = statistics.median_low(times)
    tokens, stats, _ = runs[times.index(med)]
    return Measured(tokens, stats, times)


def sweep(spec: SweepSpec, prompts: list[Prompt], on_rows: Callable[[list[dict]], None] | None = None,
          progress: bool = True, log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Run the sweep; calls `on_rows(all_rows_so_far)` after each prompt (for incremental, atomic saving)."""
    import mlx.core as mx

    from mlx_redrafter import api

    spec.check()
    cells = [(w, L) for w in spec.widths for L in spec.lengths]
    rows: list[dict[str, Any]] = []
    per_prompt = len(cells) + 1 + int(spec.mlx_lm)
    total = len(spec.dtypes) * len(prompts) * per_prompt * spec.repeats
    bar = _Progress(total, enabled=progress)
    try:
        for dtype in spec.dtypes:
            bar.describe(f"loading {dtype}")
            runner = api.load(spec.model, spec.drafter, dtype)
            if runner.drafter is None:
                raise UserError(f"no drafter for model {runner.target.name}: pass --drafter DIR (or random:0 "
                                f"for a smoke run)")
            ref = None
            if spec.mlx_lm:
                from .mlx_lm_ref import generate_ref, mlx_lm_model

                ref = mlx_lm_model(runner.target.model)
            eos = runner.tokenizer.eos_ids
            encoded = [api.encode_prompt(runner, p.text) for p in prompts]
            # Warm-up: every code path and beam shape once, short, on the first prompt (not recorded).
            bar.describe(f"{runner.target.dtype}: warm-up")
            _run_ours(runner, encoded[0], spec.warmup_tokens, 1, 2, draft=False)
            if ref is not None:
                generate_ref(ref, encoded[0], spec.warmup_tokens, eos)
            for w, L in cells:
                _run_ours(runner, encoded[0], spec.warmup_tokens, w, L, draft=True)
            base = {"device": spec.device, "model": runner.target.name, "dtype": runner.target.dtype,
                    "temperature": 0.0}
            for p, ids in zip(prompts, encoded):
                ar_runs: list = []
                ref_runs: list = []
                cell_runs: dict[tuple[int, int], list] = {c: [] for c in cells}
                for _ in range(spec.repeats):
                    bar.describe(f"{runner.target.dtype} prompt {p.id}: AR")
                    toks, st = _run_ours(runner, ids, spec.max_tokens, 0, 0, draft=False)
                    ar_runs.append((toks, st, st.decode_s))
                    bar.advance()
                    if ref is not None:
                        bar.describe(f"{runner.target.dtype} prompt {p.id}: mlx-lm")
                        rr = generate_ref(ref, ids, spec.max_tokens, eos)
                        ref_runs.append((rr.tokens, rr, rr.decode_s))
                        bar.advance()
                    for w, L in cells:
                        bar.describe(f"{runner.target.dtype} prompt {p.id}: W={w} L={L}")
                        toks, st = _run_ours(runner, ids, spec.max_tokens, w, L, draft=True)
                        cell_runs[(w, L)].append((toks, st, st.decode_s))
                        bar.advance()
                ar = _keep_median(ar_runs)
                ar_tps = ar.stats.decode_tokens_per_s
                ref_m = _keep_median(ref_runs) if ref_runs else None
                ref_tps = ref_m.stats.decode_tokens_per_s if ref_m else float("nan")
                common = {**base, "prompt_id": p.id, "category": p.category, "prompt_tokens": len(ids),
                          "ar_decode_tokens_per_s": ar_tps, "mlx_lm_decode_tokens_per_s": ref_tps,
                          "repeats": spec.repeats}
                new_rows = [_row_ours(common, "ar", "none", 0, 0, ar, ar.tokens, ar_tps, ref_tps)]
                if ref_m is not None:
                    new_rows.append(_row_ref(common, ref_m, ar.tokens, ar_tps, ref_tps))
                for (w, L), runs in cell_runs.items():
                    new_rows.append(_row_ours(common, "redrafter", runner.drafter_name, w, L, _keep_median(runs),
                                              ar.tokens, ar_tps, ref_tps))
                rows.extend(new_rows)
                if on_rows is not None:
                    on_rows(rows)
            del runner, ref
            mx.clear_cache()
    finally:
        bar.close()
    return rows


def _ratio(a: float, b: float) -> float:
    return a / b if b and b == b and b > 0 else float("nan")


def _row_ours(common: dict, method: str, drafter: str, W: int, L: int, m: Measured, ar_tokens: list[int],
              ar_tps: float, ref_tps: float) -> dict[str, Any]:
    s = m.stats
    tps = s.decode_tokens_per_s
    return {
        **common, "method": method, "drafter": drafter, "beam_width": W, "beam_length": L,
        "generated_tokens": s.generated_tokens, "steps": s.steps, "tokens_per_step": s.tokens_per_step,
        "verified_tokens": s.verified_tokens if method != "ar" else s.steps,
        "candidate_tokens": s.candidate_tokens if method != "ar" else s.steps,
        "prefill_s": s.prefill_s, "decode_s": s.decode_s, "decode_tokens_per_s": tps,
        "speedup_vs_ar": _ratio(tps, ar_tps), "speedup_vs_mlx_lm": _ratio(tps, ref_tps),
        "draft_s": s.draft_s, "verify_s": s.verify_s if method != "ar" else s.decode_s, "accept_s": s.accept_s,
        "peak_memory_gb": s.peak_memory_gb, "match_ar": _common_prefix_fraction(ar_tokens, m.tokens),
        "stop_reason": s.stop_reason, "decode_s_runs": ";".join(f"{t:.4f}" for t in m.decode_runs),
    }


def _row_ref(common: dict, m: Measured, ar_tokens: list[int], ar_tps: float, ref_tps: float) -> dict[str, Any]:
    r = m.stats
    n = len(r.tokens)
    return {
        **common, "method": "mlx_lm", "drafter": "none", "beam_width": 0, "beam_length": 0,
        "generated_tokens": n, "steps": max(n - 1, 0), "tokens_per_step": 1.0 if n > 1 else 0.0,
        "verified_tokens": max(n - 1, 0), "candidate_tokens": max(n - 1, 0),
        "prefill_s": r.prefill_s, "decode_s": r.decode_s, "decode_tokens_per_s": ref_tps,
        "speedup_vs_ar": _ratio(ref_tps, ar_tps), "speedup_vs_mlx_lm": 1.0,
        "draft_s": 0.0, "verify_s": r.decode_s, "accept_s": 0.0, "peak_memory_gb": r.peak_memory_gb,
        "match_ar": _common_prefix_fraction(ar_tokens, r.tokens), "stop_reason": r.stop_reason,
        "decode_s_runs": ";".join(f"{t:.4f}" for t in m.decode_runs),
    }


class _Progress:
    """A rich progress bar (or nothing)."""

    def __init__(self, total: int, enabled: bool = True):
        self.p = None
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.p = Progress(TextColumn("{task.description:<34}"), BarColumn(), MofNCompleteColumn(),
                              TimeElapsedColumn(), transient=False)
            self.p.start()
            self.task = self.p.add_task("starting", total=total)
        self.t0 = time.perf_counter()

    def describe(self, text: str) -> None:
        if self.p is not None:
            self.p.update(self.task, description=text)

    def advance(self) -> None:
        if self.p is not None:
            self.p.advance(self.task)

    def close(self) -> None:
        if self.p is not None:
            self.p.stop()


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per (dtype, method, W, L): means over prompts (speedup = mean of per-prompt speedups)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["dtype"], r["method"], r["beam_width"], r["beam_length"]), []).append(r)
    out = []
    for (dtype, method, w, L), rs in groups.items():
        def mean(k: str, rs: list[dict] = rs) -> float:
            vals = [float(r[k]) for r in rs if r[k] == r[k]]
            return sum(vals) / len(vals) if vals else float("nan")

        steps = sum(r["steps"] for r in rs)
        out.append({
            "dtype": dtype, "method": method, "drafter": rs[0]["drafter"], "beam_width": w, "beam_length": L,
            "prompts": len(rs), "tokens_per_step": mean("tokens_per_step"),
            "decode_tokens_per_s": mean("decode_tokens_per_s"),
            "ar_decode_tokens_per_s": mean("ar_decode_tokens_per_s"),
            "mlx_lm_decode_tokens_per_s": mean("mlx_lm_decode_tokens_per_s"), "speedup_vs_ar": mean("speedup_vs_ar"),
            "speedup_vs_mlx_lm": mean("speedup_vs_mlx_lm"), "match_ar": mean("match_ar"),
            "verified_per_step": sum(r["verified_tokens"] for r in rs) / steps if steps else 0.0,
            "candidates_per_step": sum(r["candidate_tokens"] for r in rs) / steps if steps else 0.0,
            "draft_ms_per_step": 1e3 * sum(r["draft_s"] for r in rs) / steps if steps else 0.0,
            "verify_ms_per_step": 1e3 * sum(r["verify_s"] for r in rs) / steps if steps else 0.0,
            "accept_ms_per_step": 1e3 * sum(r["accept_s"] for r in rs) / steps if steps else 0.0,
            "peak_memory_gb": max(float(r["peak_memory_gb"]) for r in rs),
        })
    return out


def best_cells(summary: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per dtype, the ReDrafter cell with the highest mean speedup over AR."""
    best: dict[str, dict[str, Any]] = {}
    for s in summary:
        if s["method"] != "redrafter":
            continue
        cur = best.get(s["dtype"])
        if cur is None or s["speedup_vs_ar"] > cur["speedup_vs_ar"]:
            best[s["dtype"]] = s
    return best
