"""Interleaved speed measurement of decoding configurations on one loaded model, with a machine-state guard.

The measurement core of `redrafter-mlx tune` and of the repository benchmark (`python -m bench sweep`).
Per prompt and repeat every configuration runs back to back (the order rotates with the repeat), so drifts of
a shared machine hit all alike; one short warm-up per configuration runs first and is not recorded. One row
per (prompt, configuration) keeps the median decode time over the repeats, their spread, and the comparison
with the autoregressive (AR) configuration of the same sampling on the same prompt.

The run's machine state (machine_state.py: load averages, other busy processes before / during / after) is
part of the result; a run that was not `quiet` warns loudly on stderr.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from itertools import product
from typing import Any

from mlx_redrafter.api import DecodeOptions, LoadedModel, encode_prompt, settings
from mlx_redrafter.api import decode as api_decode
from mlx_redrafter.defaults import (
    DEFAULT_ANSWERS_WIDTH,
    DEFAULT_LOOKUP_MAX_LENGTH,
    DEFAULT_LOOKUP_WIDTH,
    TUNE_MIN_SPEEDUP,
    TUNE_MIN_TOKENS_PER_STEP,
    WARMUP_TOKENS,
)
from mlx_redrafter.draft import modes
from mlx_redrafter.draft.modes import DRAFTER_NAMES, MODES, Mode
from mlx_redrafter.errors import UserError
from mlx_redrafter.generate import Stats, collect
from mlx_redrafter.sampling import GREEDY, Sampling
from mlx_redrafter.system.machine_state import MachineWatch, loadavg

# A decoder other than ours (e.g. mlx-lm's): prompt ids and options in, (new token ids, filled Stats) out.
Decoder = Callable[[list[int], DecodeOptions], tuple[list[int], Stats]]


@dataclass
class Config:
    """One configuration to measure, under a name; `decoder` replaces our decoding loops (e.g. mlx-lm)."""

    name: str
    options: DecodeOptions
    decoder: Decoder | None = None
    decoder_name: str = "ours"

    @property
    def is_ar(self) -> bool:
        """Our own plain autoregressive decoding: the reference of the speedups."""
        return self.decoder is None and not modes.get(self.options.draft).drafts


def config_name(draft: str | Mode, width: int = 0, length: int = 0, sampling: Sampling = GREEDY) -> str:
    """Stable name of a configuration, e.g. 'ar', 'rnn-w2-l3', 'lookup-w1-l4@t0.7', 'rnn-w1-l3@t0.7-typical'
    (AR samples the same way whatever the acceptance rule, so its name has no rule)."""
    mode = modes.get(draft)
    drafts = mode.drafts
    name = f"{mode.name}-w{width}-l{length}" if drafts else "ar"
    if sampling.greedy:
        return name
    rule = "-typical" if sampling.accept == "typical" and drafts else ""
    return f"{name}@t{sampling.temperature:g}{rule}"


def grid_configs(drafts: list[str | Mode], widths: list[int], lengths: list[int], max_tokens: int,
                 sampling: Sampling = GREEDY, lookup_width: int = DEFAULT_LOOKUP_WIDTH,
                 answers_widths: tuple[int, ...] = (DEFAULT_ANSWERS_WIDTH,),
                 drafter_vocabs: tuple[int | None, ...] = (None,),
                 lookup_max_lengths: tuple[int, ...] = (DEFAULT_LOOKUP_MAX_LENGTH,),
                 lookup_indexes: tuple[str | None, ...] = (None,)) -> list[Config]:
    """AR plus every draft mode x width x length. The width sets the option its mode's row names (`Mode.width`):
    W of a drafter, the lookup width (the drafter's modes keep `lookup_width`), or the nodes of Medusa's tree
    (the first W of mc_sim_7b_63). Modes with lookup run once per answer-table width (names get '-aK' where K
    is not the default), per longest lookup copy ('-mN' where N is not the default) and per context index
    ('-iNAME' where not the mode's own, `Mode.lookup_index`; None: the mode's own), modes with the
    ReDrafter once per drafter vocabulary (None: the default; else names get '-vN')."""
    base = DecodeOptions(draft="none", max_tokens=max_tokens, sampling=sampling)
    configs = [Config(config_name("none", sampling=sampling), base)]
    for draft in drafts:
        mode = modes.get(draft)
        copies = mode.uses("lookup")
        for w in widths:
            for length in lengths:
                for a, m, v, ix in product(answers_widths if copies else (DEFAULT_ANSWERS_WIDTH,),
                                           lookup_max_lengths if copies else (DEFAULT_LOOKUP_MAX_LENGTH,),
                                           drafter_vocabs if mode.uses("rnn") else (None,),
                                           lookup_indexes if copies else (None,)):
                    width = {"beam_width": {"beam_width": w, "lookup_width": lookup_width},
                             "lookup_width": {"lookup_width": w}, "medusa_tree": {"medusa_tree": f"mc_sim_7b_63:{w}"},
                             }[mode.width]
                    opts = base.updated(draft=draft, beam_length=length, answers_width=a, drafter_vocab=v,
                                        lookup_max_length=m, lookup=ix, **width)
                    opts.check()
                    suffix = (f"-a{a}" if a != DEFAULT_ANSWERS_WIDTH else "") + (
                        f"-m{m}" if m != DEFAULT_LOOKUP_MAX_LENGTH else "") + (f"-v{v}" if v is not None else "") + (
                        f"-i{ix}" if ix not in (None, mode.lookup_index) else "")
                    configs.append(Config(config_name(draft, w, length, sampling) + suffix, opts))
    return configs


def decode(lm: LoadedModel, ids: list[int], options: DecodeOptions, profile: bool = False) -> tuple[list[int], Stats]:
    """Token ids and statistics of one generation with our loops (no detokenization, nothing printed).
    `profile=True` evaluates every phase of a speculative step at its boundary (`Stats.phase_s`)."""
    return collect(api_decode(lm, ids, options, profile=profile))


@dataclass
class SweepResult:
    """Rows (one per prompt x configuration) and the machine state the run was taken in."""

    rows: list[dict[str, Any]]
    machine_state: dict[str, Any]
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def quiet(self) -> bool:
        """Whether nothing else kept the machine busy during the run."""
        return bool(self.machine_state.get("quiet"))


Progress = Callable[[str, int, int], None]  # (what runs now, runs done, runs in all)


def print_progress(what: str, done: int, total: int) -> None:
    """A Progress that writes `[done/total] what` to stderr (one updating line on a terminal)."""
    tty = sys.stderr.isatty()
    end = "\n" if not tty or done == total else ""
    print(f"{chr(13) if tty else ''}[{done}/{total}] {what:<48}", end=end, file=sys.stderr, flush=True)


def parse_drafts(text: str | None) -> list[str] | None:
    """Draft mode names from a --drafts comma list (None when not given); a one-line UserError for a name that
    is not a drafting mode."""
    if text is None:
        return None
    drafts = [d.strip() for d in text.split(",") if d.strip()]
    drafting = [m.name for m in MODES.values() if m.drafts]
    bad = [d for d in drafts if d not in drafting]
    if bad or not drafts:
        raise UserError(f"--drafts takes a comma list of {', '.join(drafting)} (got {text!r})")
    return list(dict.fromkeys(drafts))


def check_shapes(widths: list[int], lengths: list[int], draft: str = "auto", max_tokens: int = 128) -> None:
    """A one-line UserError naming the first (W, L) of the grid that is not a shape to decode with (before any
    model loads)."""
    from mlx_redrafter.api import decode_options

    for w, length in product(widths, lengths):
        try:
            decode_options(draft=draft, beam_width=w, lookup_width=w, beam_length=length, max_tokens=max_tokens)
        except UserError as e:
            raise UserError(f"W = {w}, L = {length} (--widths, --lengths) is not a shape to decode with: {e}"
                            ) from None


def sweep_drafts(text: str | None, drafter_kind: str | None) -> list[str]:
    """The draft modes a sweep measures with a drafter of this kind (None: none loaded): those of --drafts, or by
    default the table's swept rows it can serve (`modes.swept`). A named mode needing another drafter is a
    one-line UserError."""
    named = parse_drafts(text)
    if named is None:
        return [m.name for m in modes.swept(drafter_kind)]
    needy = [d for d in named if MODES[d].drafter not in (None, drafter_kind)]
    if needy:
        kinds = sorted({DRAFTER_NAMES[MODES[d].drafter] for d in needy})
        loaded = f"a {DRAFTER_NAMES[drafter_kind]} drafter is loaded" if drafter_kind else "there is none"
        raise UserError(f"--drafts {', '.join(needy)} need a {' or '.join(kinds)} drafter, and {loaded}: pass "
                        "--drafter DIR with one (or random:0 for a smoke run of rnn modes), or --drafts lookup")
    return named


def sweep(lm: LoadedModel, prompts: list[dict], configs: list[Config], repeats: int = 1,
          warmup_tokens: int = WARMUP_TOKENS, progress: Progress | None = None,
          on_prompt: Callable[[list[dict[str, Any]]], None] | None = None, watch_interval: float = 1.0,
          warn: bool = True) -> SweepResult:
    """Measure every configuration on every prompt ({"prompt", optional "id"/"category"}), interleaved.

    Each row holds the configuration's settings, the median-time repeat's statistics (`Stats.as_dict()`),
    `decode_s` (median), `decode_s_min` / `decode_s_max` / `decode_s_runs`, `speedup_vs_ar` (decode tokens/s
    over the AR row of the same prompt and sampling), `equal_ar` (same token ids) and `match_ar` (common prefix
    / longer length), and the 1-minute load average when the prompt started and ended. `on_prompt(rows)` is
    called after every prompt (for incremental saving)."""
    if repeats < 1:
        raise UserError(f"--repeats must be >= 1 (got {repeats})")
    if not prompts or not configs:
        raise UserError("nothing to measure: no prompts or no configurations")
    ar_of = _ar_names(configs)
    config_settings = {c.name: {**settings(lm, c.options), "config": c.name, "decoder": c.decoder_name}
                       for c in configs}  # also checks every draft mode against the lm
    encoded = [encode_prompt(lm, p["prompt"]) for p in prompts]
    total, done = len(configs) * (1 + repeats * len(prompts)), 0
    watch = MachineWatch(watch_interval)
    watch.start()
    for c in configs:  # warm-up: every code path and shape once, not recorded
        if progress:
            progress(f"warm-up {c.name}", done, total)
        _run(lm, c, encoded[0], min(warmup_tokens, c.options.max_tokens))
        done += 1
    rows: list[dict[str, Any]] = []
    for i, (p, ids) in enumerate(zip(prompts, encoded)):
        load_before = (loadavg() or [float("nan")])[0]
        runs: dict[str, list[tuple[list[int], Stats]]] = {c.name: [] for c in configs}
        for r in range(repeats):
            k = r % len(configs)
            for c in configs[k:] + configs[:k]:
                if progress:
                    progress(f"prompt {i + 1}/{len(prompts)} {c.name}", done, total)
                runs[c.name].append(_run(lm, c, ids, c.options.max_tokens))
                done += 1
        load_after = (loadavg() or [float("nan")])[0]
        common = {"prompt_id": prompt_id(p, i), "category": str(p.get("category", "")),
                  "repeats": repeats, "load1_before": load_before, "load1_after": load_after}
        rows.extend(_rows(configs, runs, ar_of, config_settings, common))
        if on_prompt is not None:
            on_prompt(rows)
    if progress:
        progress("done", done, total)
    return SweepResult(rows, watch.stop(warn), {"repeats": repeats, "warmup_tokens": warmup_tokens,
                                                 "prompts": len(prompts), "configs": [c.name for c in configs]})


def prompt_id(row: dict, index: int) -> str:
    """A prompt's id: its "id" or "question_id" field, else its 1-based position."""
    return str(row.get("id", row.get("question_id", index + 1)))


def _ar_names(configs: list[Config]) -> dict[str, str]:
    """Configuration name -> name of the AR configuration it is compared with (same sampling, else the first)."""
    ars = [c for c in configs if c.is_ar]
    if not ars:
        raise UserError("a sweep needs an autoregressive configuration (draft 'none') as its reference")
    def same(a: Sampling, b: Sampling) -> bool:  # the acceptance rule does not change AR sampling
        return replace(a, accept="exact") == replace(b, accept="exact")

    return {c.name: next((a.name for a in ars if same(a.options.sampling, c.options.sampling)), ars[0].name)
            for c in configs}


def _run(lm: LoadedModel, c: Config, ids: list[int], max_tokens: int) -> tuple[list[int], Stats]:
    opts = replace(c.options, max_tokens=max_tokens)
    return c.decoder(ids, opts) if c.decoder is not None else decode(lm, ids, opts)


def common_prefix_fraction(ref: list[int], other: list[int]) -> float:
    """Length of the common prefix over the longer length (1.0 = identical)."""
    n = next((i for i, (a, b) in enumerate(zip(ref, other)) if a != b), min(len(ref), len(other)))
    longest = max(len(ref), len(other))
    return n / longest if longest else 1.0


def _ratio(a: float, b: float) -> float:
    return a / b if b and b == b and b > 0 else float("nan")


def _rows(configs: list[Config], runs: dict[str, list[tuple[list[int], Stats]]], ar_of: dict[str, str],
          config_settings: dict[str, dict], common: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per configuration for one prompt (the median-time repeat; speedups vs its AR row)."""
    kept = {}
    for name, rs in runs.items():
        times = [s.decode_s for _, s in rs]
        med = statistics.median_low(times)
        tokens, stats = rs[times.index(med)]
        kept[name] = (tokens, stats, times)
    rows = []
    for c in configs:
        tokens, stats, times = kept[c.name]
        ar_tokens, ar_stats, _ = kept[ar_of[c.name]]
        tps, ar_tps = stats.decode_tokens_per_s, ar_stats.decode_tokens_per_s
        rows.append({
            **config_settings[c.name], **common, **stats.as_dict(),
            "decode_s": stats.decode_s, "decode_s_min": min(times), "decode_s_max": max(times),
            "decode_s_runs": [round(t, 4) for t in times], "decode_tokens_per_s": tps,
            "ar_decode_tokens_per_s": ar_tps, "speedup_vs_ar": _ratio(tps, ar_tps),
            "equal_ar": tokens == ar_tokens, "match_ar": common_prefix_fraction(ar_tokens, tokens),
        })
    return rows


# ------------------------------------------------------------------------------------------- summary, decision


def _mean(vals: list[Any]) -> float:
    vals = [float(v) for v in vals if v == v]
    return sum(vals) / len(vals) if vals else float("nan")


def pooled_speedup(rs: list[dict[str, Any]]) -> float:
    """Our AR's time for the tokens these rows decoded (at its tokens/s on each prompt) over the rows' own time:
    the speedup over the whole prompt set, where long and slow prompts weigh more than in the mean of ratios."""
    spent = sum(r["decode_s"] for r in rs)
    ar_time = sum((r["generated_tokens"] - 1) / r["ar_decode_tokens_per_s"] for r in rs if r["ar_decode_tokens_per_s"])
    return ar_time / spent if spent > 0 else float("nan")


def summarize(rows: list[dict[str, Any]], extra_means: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """One record per (dtype, configuration) from the rows' median repeats: the speedup over AR pooled over the
    prompts (`pooled_speedup`: what a user waiting on the whole workload sees) with the per-prompt ratios' mean,
    median, min and max beside it, other rates as means over prompts, per-step costs pooled over prompts,
    `decode_spread` the mean (max - min) / median of the repeats, and `equal_ar` the share of prompts whose ids
    equal AR's."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["dtype"], r["config"]), []).append(r)
    return [_summary(rs, extra_means) for rs in groups.values()]


def _summary(rs: list[dict[str, Any]], extra_means: tuple[str, ...]) -> dict[str, Any]:
    steps = sum(r["steps"] for r in rs) or float("inf")  # per-step costs are 0 without steps
    phases = sorted({k for r in rs for k in r["phase_s"]})
    sources = sorted({k for r in rs for k in r["source_tokens_per_step"]})
    rec = {k: rs[0][k] for k in ("config", "decoder", "model", "dtype", "draft", "drafter", "beam_width",
                                 "beam_length", "lookup_width", "lookup", "temperature")}
    rec["medusa_tree"] = rs[0].get("medusa_tree", "")
    rec["answers_width"] = rs[0].get("answers_width", 0)
    rec["drafter_vocab"] = rs[0].get("drafter_vocab", 0)
    rec["draft_confidence"] = rs[0].get("draft_confidence", 0)
    rec["lookup_max_length"] = rs[0].get("lookup_max_length", 0)
    rec["accept"] = rs[0].get("accept", "greedy")  # greedy, exact or typical
    rec.update({
        "prompts": len(rs),
        # pooled (all prompts' decided tokens over all their target calls), like speedup_vs_ar: the mean of the
        # per-prompt figures is carried by a few copy-heavy prompts
        "tokens_per_step": sum(r["tokens_per_step"] * r["steps"] for r in rs) / steps,
        "tokens_per_step_mean": _mean([r["tokens_per_step"] for r in rs]),
        "decode_tokens_per_s": _mean([r["decode_tokens_per_s"] for r in rs]),
        "ar_decode_tokens_per_s": _mean([r["ar_decode_tokens_per_s"] for r in rs]),
        "speedup_vs_ar": pooled_speedup(rs),
        "speedup_vs_ar_mean": _mean([r["speedup_vs_ar"] for r in rs]),
        "speedup_vs_ar_median": statistics.median([float(r["speedup_vs_ar"]) for r in rs]),
        "speedup_vs_ar_min": min(float(r["speedup_vs_ar"]) for r in rs),
        "speedup_vs_ar_max": max(float(r["speedup_vs_ar"]) for r in rs),
        **{k: _mean([r[k] for r in rs]) for k in extra_means},
        "equal_ar": sum(bool(r["equal_ar"]) for r in rs) / len(rs),
        "match_ar": _mean([r["match_ar"] for r in rs]),
        "decode_s": sum(r["decode_s"] for r in rs),  # the median repeats, summed over prompts
        "decode_spread": _mean([(r["decode_s_max"] - r["decode_s_min"]) / r["decode_s"] for r in rs
                                if r["decode_s"] > 0]),
        "verified_per_step": sum(r["verified_tokens"] for r in rs) / steps,
        "candidates_per_step": sum(r["candidate_tokens"] for r in rs) / steps,
        "source_tokens_per_step": {k: _mean([r["source_tokens_per_step"].get(k, float("nan")) for r in rs])
                                   for k in sources},
        "phase_ms_per_step": {k: 1e3 * sum(r["phase_s"].get(k, 0.0) for r in rs) / steps for k in phases},
        "decode_ms_per_step": 1e3 * sum(r["decode_s"] for r in rs) / steps,
        "peak_memory_gb": max(float(r["peak_memory_gb"]) for r in rs),
    })
    return rec


def is_cell(s: dict[str, Any]) -> bool:
    """A speculative configuration of ours (not AR, not an external baseline)."""
    return s["decoder"] == "ours" and modes.get(s["draft"]).drafts


def cell_width(s: dict[str, Any]) -> int:
    """A cell's width as the grid names it (`Mode.width`): W of a drafter, the lookup width, or tree nodes."""
    option = modes.get(s["draft"]).width
    if option == "medusa_tree":
        tree = str(s.get("medusa_tree", ""))
        return int(tree.rsplit(":", 1)[1]) if ":" in tree else 0
    return s[option] if option else 0


def best_cells(summary: list[dict[str, Any]], key: Callable[[dict], tuple] | None = None) -> dict[tuple, dict]:
    """The speculative configuration with the highest (pooled) speedup over AR per group (default: per draft mode,
    dtype, temperature and acceptance rule)."""
    key = key or (lambda s: (s["draft"], s["dtype"], s["temperature"], s["accept"]))
    best: dict[tuple, dict] = {}
    for s in summary:
        if is_cell(s):
            k = key(s)
            if k not in best or s["speedup_vs_ar"] > best[k]["speedup_vs_ar"]:
                best[k] = s
    return best


TUNED_MEASUREMENTS = ("speedup_vs_ar", "decode_tokens_per_s", "ar_decode_tokens_per_s", "tokens_per_step",
                      "source_tokens_per_step", "equal_ar")


def decide(summary: list[dict[str, Any]], min_speedup: float = TUNE_MIN_SPEEDUP,
           min_tokens_per_step: float = TUNE_MIN_TOKENS_PER_STEP) -> dict[str, Any]:
    """The tuned entry: per dtype, the fastest speculative cell that beats that dtype's AR by `min_speedup` and
    decides at least `min_tokens_per_step` tokens per target call (below that, a measured gain is noise), else
    AR ('decision': 'ar', 'draft': 'none'); across dtypes the highest decode tokens/s wins."""
    eligible = [s for s in summary if is_cell(s) and s["tokens_per_step"] >= min_tokens_per_step
                and s["speedup_vs_ar"] >= min_speedup]
    per_dtype = best_cells(eligible, key=lambda s: (s["dtype"],))
    runner_up = best_cells(summary, key=lambda s: (s["dtype"],))
    options = []
    for ar in (s for s in summary if s["decoder"] == "ours" and not modes.get(s["draft"]).drafts):
        cell = per_dtype.get((ar["dtype"],))
        if cell is not None:  # settings report 0 for a width the draft mode does not use: leave those out
            shape = {k: cell[k] for k in ("beam_width", "beam_length", "lookup_width") if cell[k] > 0}
            options.append({"decision": "speculative", "dtype": ar["dtype"], "draft": cell["draft"], **shape,
                            "config": cell["config"], **{k: cell[k] for k in TUNED_MEASUREMENTS}})
        else:
            best = runner_up.get((ar["dtype"],))
            options.append({"decision": "ar", "dtype": ar["dtype"], "draft": "none", "speedup_vs_ar": 1.0,
                            "decode_tokens_per_s": ar["decode_tokens_per_s"],
                            "ar_decode_tokens_per_s": ar["decode_tokens_per_s"], "tokens_per_step": 1.0,
                            "best_cell": None if best is None else {k: best[k] for k in (
                                "config", "speedup_vs_ar", "tokens_per_step")}})
    if not options:
        raise UserError("no autoregressive reference was measured: nothing to decide")
    return max(options, key=lambda o: o["decode_tokens_per_s"])
