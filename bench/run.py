"""The full benchmark: every draft mode x width x length vs our AR and mlx-lm's AR, interleaved
(mlx_redrafter.sweep), per dtype; then the profile of the best cell; CSV, JSON, plots and README.md."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from mlx_redrafter.defaults import (
    BENCH_GRID,
    DEFAULT_ANSWERS_WIDTH,
    DEFAULT_LOOKUP_MAX_LENGTH,
    WARMUP_TOKENS,
)
from mlx_redrafter.errors import UserError

RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclass
class BenchSpec:
    """What to measure."""

    device: str
    model: str | None = None
    drafter: str = "default"
    drafts: str | None = None  # comma list; None: the swept rows of draft/modes.py the drafter serves
    dtypes: list[str] = field(default_factory=lambda: ["auto"])
    temperatures: list[float] = field(default_factory=lambda: [0.0])
    accepts: list[str] = field(default_factory=lambda: ["exact"])  # acceptance rules measured at T > 0
    widths: list[int] = field(default_factory=lambda: list(BENCH_GRID["widths"]))
    lengths: list[int] = field(default_factory=lambda: list(BENCH_GRID["lengths"]))
    answers_widths: list[int] = field(default_factory=lambda: [DEFAULT_ANSWERS_WIDTH])  # per lookup cell
    drafter_vocabs: list[int | None] = field(default_factory=lambda: [None])  # per rnn cell; None: the default
    lookup_max_lengths: list[int] = field(default_factory=lambda: [DEFAULT_LOOKUP_MAX_LENGTH])  # per lookup cell
    lookup_indexes: list[str | None] = field(default_factory=lambda: [None])  # per lookup cell; None: the mode's
    max_tokens: int = BENCH_GRID["max_tokens"]
    num_prompts: int = BENCH_GRID["num_prompts"]
    prompts_file: Path | None = None
    repeats: int = BENCH_GRID["repeats"]
    warmup_tokens: int = WARMUP_TOKENS
    mlx_lm: bool = True
    llama_cpp: bool | None = None  # llama.cpp's AR as a baseline; None: where it is installed and the model is a GGUF
    profile: bool = True

    def check(self) -> None:
        """One-line UserError for bad values (before anything is loaded)."""
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", self.device or ""):
            raise UserError(f"--device {self.device!r}: use letters, digits, '.', '_' or '-' (it names a folder)")
        if min(self.widths) < 1:
            raise UserError(f"--widths must be >= 1 (got {self.widths})")
        if min(self.lengths) < 2:
            raise UserError(f"--lengths must be >= 2: the first token plus at least one draft (got {self.lengths})")
        if self.max_tokens < 2:
            raise UserError(f"--max-tokens must be >= 2 (got {self.max_tokens})")
        if self.repeats < 1:
            raise UserError(f"--repeats must be >= 1 (got {self.repeats})")
        bad = [a for a in self.accepts if a not in ("exact", "typical")]
        if bad or not self.accepts:
            raise UserError(f"--accepts takes exact and/or typical (got {','.join(self.accepts) or 'nothing'})")
        if not self.dtypes:
            raise UserError("--dtypes is empty")
        from mlx_redrafter.draft.lookup import INDEXES

        bad = [x for x in self.lookup_indexes if x is not None and x not in INDEXES]
        if bad or not self.lookup_indexes:
            got = ",".join(str(x) for x in self.lookup_indexes) or "nothing"
            raise UserError(f"--lookup-indexes takes {', '.join(INDEXES)} (got {got})")


def samplings(temperatures: list[float], accepts: tuple[str, ...] | list[str] = ("exact",)) -> list[Any]:
    """Sampling settings per temperature and, at T > 0, per acceptance rule (seeded, so repeats decide the same
    tokens)."""
    from mlx_redrafter.sampling import Sampling

    return [Sampling(temperature=t, seed=0 if t > 0 else None, accept=a)
            for t in temperatures for a in (accepts if t > 0 else ["exact"])]


def configs_for(spec: BenchSpec, lm: Any) -> list[Any]:
    """AR, mlx-lm (optional) and every cell, per temperature."""
    from mlx_redrafter import sweep

    drafts = sweep.sweep_drafts(spec.drafts, lm.drafter_kind)
    configs = []
    for s in samplings(spec.temperatures, spec.accepts):
        names = {c.name for c in configs}  # AR at T runs once, whatever the rules compared at T
        configs += [c for c in sweep.grid_configs(drafts, spec.widths, spec.lengths, spec.max_tokens, s,
                                                      answers_widths=tuple(spec.answers_widths),
                                                      drafter_vocabs=tuple(spec.drafter_vocabs),
                                                      lookup_max_lengths=tuple(spec.lookup_max_lengths),
                                                      lookup_indexes=tuple(spec.lookup_indexes))
                    if c.name not in names]
    if spec.mlx_lm:
        from .mlx_lm_ref import MlxLmDecoder, mlx_lm_configs

        _after_first_ar(configs, mlx_lm_configs(MlxLmDecoder(lm.target.model, lm.tokenizer.eos_ids),
                                                [c for c in configs if c.is_ar]))
    gguf = llama_cpp_file(spec, lm)
    if gguf is not None:
        from .llama_cpp_ref import LlamaCppDecoder, llama_cpp_configs

        _after_first_ar(configs, llama_cpp_configs(LlamaCppDecoder(gguf, lm.tokenizer.eos_ids, context=4096),
                                                   [c for c in configs if c.is_ar]))
    return configs


def _after_first_ar(configs: list[Any], baseline: list[Any]) -> None:
    """Insert a baseline's configurations right after our first AR configuration."""
    k = next(i for i, c in enumerate(configs) if c.is_ar) + 1
    configs[k:k] = baseline


def llama_cpp_file(spec: BenchSpec, lm: Any) -> Path | None:
    """The GGUF llama.cpp's baseline runs, or None where it is not measured (`BenchSpec.llama_cpp`); asked for
    explicitly where it cannot run: a one-line UserError."""
    from .llama_cpp_ref import INSTALL_HINT, available, gguf_of

    if spec.llama_cpp is False:
        return None
    gguf = gguf_of(Path(lm.target.path))
    if spec.llama_cpp is None:
        return gguf if available() else None
    if not available():
        raise UserError(f"--llama-cpp: llama-cpp-python is not installed: {INSTALL_HINT}")
    if gguf is None:
        raise UserError(f"--llama-cpp: {lm.target.name} was not loaded from one GGUF file, which llama.cpp needs: "
                        "pass --no-llama-cpp")
    return gguf


BASELINES = ("mlx_lm", "llama_cpp")  # decoders other than ours whose speed every row is compared with


def add_baseline_speedups(rows: list[dict[str, Any]]) -> None:
    """Per row and baseline: the baseline row's decode tokens/s on the same prompt, dtype and temperature
    (`<baseline>_decode_tokens_per_s`, NaN where it did not run) and the ratio (`speedup_vs_<baseline>`)."""
    for name in BASELINES:
        ref = {(r["dtype"], r["prompt_id"], r["temperature"]): r["decode_tokens_per_s"] for r in rows
               if r["decoder"] == name}
        for r in rows:
            tps = ref.get((r["dtype"], r["prompt_id"], r["temperature"]), float("nan"))
            r[f"{name}_decode_tokens_per_s"] = tps
            r[f"speedup_vs_{name}"] = r["decode_tokens_per_s"] / tps if tps == tps and tps > 0 else float("nan")


def profile_cell(spec: BenchSpec, cell: dict[str, Any], options: Any, prompt: dict) -> dict[str, Any]:
    """One generation of a cell with every step phase evaluated at its boundary (`Stats.phase_s`): an honest
    split of a step, taken after the sweep (it runs a little slower than the sweep's rows)."""
    from mlx_redrafter import api, sweep

    lm = api.load(spec.model, spec.drafter, cell["dtype"])
    ids = api.encode_prompt(lm, prompt["prompt"])
    sweep.decode(lm, ids, replace(options, max_tokens=min(spec.warmup_tokens, spec.max_tokens)), profile=True)
    _, st = sweep.decode(lm, ids, options, profile=True)
    steps = max(st.steps, 1)
    return {"config": cell["config"], "dtype": cell["dtype"], "prompt_id": sweep.prompt_id(prompt, 0),
            "generated_tokens": st.generated_tokens, "steps": st.steps, "tokens_per_step": st.tokens_per_step,
            "decode_s": st.decode_s, "decode_tokens_per_s": st.decode_tokens_per_s,
            "phase_ms_per_step": {k: 1e3 * v / steps for k, v in st.phase_s.items()},
            "loop_ms_per_step": 1e3 * (st.decode_s - sum(st.phase_s.values())) / steps}


def run_bench(spec: BenchSpec, out_root: Path = RESULTS_DIR, progress: bool = True) -> dict[str, Any]:
    """Run the sweep and write everything under out_root/<device>/; returns the JSON record (with `dir`)."""
    from mlx_redrafter import api, sweep
    from mlx_redrafter.prompts import first_turns, packaged
    from mlx_redrafter.system.machine import machine_info

    from . import plots, report

    spec.check()
    sweep.parse_drafts(spec.drafts)  # syntax, before loading anything
    prompts = first_turns(spec.prompts_file, spec.num_prompts, spread=True)
    out = out_root / spec.device  # created by the first write
    run_id = time.strftime("%Y%m%d-%H%M%S")
    stem = f"bench-{run_id}"
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    states, names, options = [], {}, {}
    for dtype in spec.dtypes:
        lm = api.load(spec.model, spec.drafter, dtype)
        names = {"model": lm.target.name, "drafter": lm.drafter_name}
        configs = configs_for(spec, lm)
        options.update({c.name: c.options for c in configs})
        done = list(rows)
        res = sweep.sweep(lm, prompts, configs, spec.repeats, spec.warmup_tokens,
                          progress=sweep.print_progress if progress else None,
                          on_prompt=lambda new, done=done: report.write_csv(out / f"{stem}.csv", done + new,
                                                                           spec.device))
        rows += res.rows
        states.append({"dtype": lm.target.dtype, **res.machine_state})
        del lm
    add_baseline_speedups(rows)
    report.write_csv(out / f"{stem}.csv", rows, spec.device)
    summary = sweep.summarize(rows, extra_means=tuple(f"{k}{name}{v}" for name in BASELINES
                                                       for k, v in (("speedup_vs_", ""), ("", "_decode_tokens_per_s"))))
    best = sweep.best_cells(summary)
    meta: dict[str, Any] = {
        "device": spec.device, "run_id": run_id, "machine": machine_info(), **names,
        "settings": {"drafts": sorted({s["draft"] for s in summary if sweep.is_cell(s)}), "widths": spec.widths,
                     "lengths": spec.lengths, "dtypes": sorted({r["dtype"] for r in rows}),
                     "temperatures": spec.temperatures, "max_tokens": spec.max_tokens, "num_prompts": len(prompts),
                     "prompts_file": str(spec.prompts_file or packaged()), "repeats": spec.repeats,
                     "warmup_tokens": spec.warmup_tokens, "mlx_lm": spec.mlx_lm,
                     "llama_cpp": any(r["decoder"] == "llama_cpp" for r in rows),
                     "prompts": [{"id": sweep.prompt_id(p, i), "category": p.get("category", "")}
                                 for i, p in enumerate(prompts)]},
        "quiet": all(s["quiet"] for s in states), "machine_state": states,
        "speedup_definition": "pooled: our AR's decode time for the same tokens over the config's, all prompts "
                              "together (same dtype and temperature); decode excludes prefill and the first token; "
                              "speedup_vs_ar_mean / _median / _min / _max: over the per-prompt ratios",
        "summary": summary, "best": list(best.values()),
    }
    if spec.profile and best:
        top = max(best.values(), key=lambda s: (s["temperature"] == 0, s["speedup_vs_ar"]))
        meta["profile"] = profile_cell(spec, top, options[top["config"]], prompts[0])
    meta["elapsed_s"] = round(time.perf_counter() - started, 1)
    files = {"csv": f"{stem}.csv", "json": f"{stem}.json", **plots.plot_all(meta, out, stem)}
    meta["files"] = files
    report.write_json(out / f"{stem}.json", meta)
    report.write_readme(out / "README.md", meta)
    return {**meta, "dir": out}
