"""Benchmark outputs: the CSV (one row per prompt x configuration), the JSON record and README.md."""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlx_redrafter.files import write_atomic
from mlx_redrafter.sweep import cell_width


def save_report(out_dir: Path, stem: str, report: dict[str, Any], markdown: Callable[[dict[str, Any]], str]) -> None:
    """Write OUT_DIR/STEM.json (the record) and OUT_DIR/STEM.md (its tables), each atomically."""
    write_atomic(out_dir / f"{stem}.json", json.dumps(report, indent=2) + "\n")
    write_atomic(out_dir / f"{stem}.md", markdown(report))


COLUMNS = [
    "device", "model", "drafter", "dtype", "config", "decoder", "draft", "beam_width", "beam_length", "lookup_width",
    "lookup", "answers_width", "drafter_vocab", "lookup_max_length", "temperature", "accept", "prompt_id", "category",
    "prompt_tokens", "generated_tokens", "steps", "tokens_per_step", "rnn_tokens_per_step", "lookup_tokens_per_step",
    "answers_tokens_per_step", "verified_tokens", "candidate_tokens", "prefill_s", "decode_s", "decode_s_min",
    "decode_s_max", "decode_s_runs", "repeats", "decode_tokens_per_s", "ar_decode_tokens_per_s",
    "mlx_lm_decode_tokens_per_s", "llama_cpp_decode_tokens_per_s", "speedup_vs_ar", "speedup_vs_mlx_lm",
    "speedup_vs_llama_cpp", "equal_ar", "match_ar", "draft_s", "verify_s",
    "peak_memory_gb", "stop_reason", "load1_before", "load1_after",
]


def _cell(v: Any) -> Any:
    if isinstance(v, float):
        return "" if math.isnan(v) else f"{v:.6g}"
    if isinstance(v, list):
        return ";".join(str(x) for x in v)
    return v


def csv_row(row: dict[str, Any], device: str) -> dict[str, Any]:
    """A sweep row flattened to COLUMNS (per-source tokens per step and the step phases as columns)."""
    flat = {**row, "device": device}
    for src in ("rnn", "lookup", "answers"):
        flat[f"{src}_tokens_per_step"] = row["source_tokens_per_step"].get(src, "")
    for phase in ("draft", "verify"):
        flat[f"{phase}_s"] = row["phase_s"].get(phase, "")
    return {k: _cell(flat.get(k, "")) for k in COLUMNS}


def write_csv(path: Path, rows: list[dict[str, Any]], device: str) -> None:
    """All rows so far, written atomically (a partial run keeps its finished prompts)."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow(csv_row(r, device))
    write_atomic(path, buf.getvalue())


def write_json(path: Path, meta: dict[str, Any]) -> None:
    """The run's record (NaN written as null)."""
    write_atomic(path, json.dumps(_nan_to_none(meta), indent=2, default=str) + "\n")


def _nan_to_none(x: Any) -> Any:
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: _nan_to_none(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_nan_to_none(v) for v in x]
    return x


def machine_state_lines(meta: dict[str, Any]) -> list[str]:
    """The machine state the run was taken in, for the top of the README."""
    lines = []
    for s in meta["machine_state"]:
        b, a = s["before"], s["after"]
        head = "quiet" if s["quiet"] else "**NOT quiet: timings are not representative of this machine**"
        lines.append(f"Machine state ({s['dtype']} sweep, {s['during']['seconds']} s): {head}. 1/5/15-min load "
                     f"average before {'/'.join(map(str, b['loadavg']))}, after {'/'.join(map(str, a['loadavg']))} "
                     f"({s['cores']} cores; this process used {s['during']['own_cores']} cores on average).")
        lines += [f"- {r}" for r in s["reasons"]]
        lines.append("")
    return lines


def _f(v: Any, fmt: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)


BASELINE_NAMES = {"mlx_lm": "mlx-lm", "llama_cpp": "llama.cpp"}  # decoders other than ours, as the report names them


def readme(meta: dict[str, Any]) -> str:
    """README.md of a results folder: machine state first, then the best cells and the profile."""
    m, st = meta["machine"], meta["settings"]
    lines = [f"# Benchmark results: {meta['device']}", "", *machine_state_lines(meta),
             f"Latest run `{meta['run_id']}`: model `{meta.get('model', '')}`, drafter `{meta.get('drafter', '')}`, "
             f"{st['num_prompts']} prompts ({Path(st['prompts_file']).name}), max {st['max_tokens']} new tokens, "
             f"temperatures {st['temperatures']}, {st['repeats']} repeat(s) (median kept), draft modes {st['drafts']}, "
             f"widths {st['widths']}, lengths {st['lengths']}; {meta['elapsed_s']} s.", "",
             f"Machine: {m['cpu']} ({m['cpu_cores']} cores, {m['memory_gb']} GB, {m.get('cpu_features') or '-'}), "
             f"{m['os_pretty']}, MLX {m['mlx']} ({m['backend']}), mlx-lm {m['mlx_lm']}, BLAS {m['blas']}, "
             f"Python {m['python']}.", "",
             "Best cell per draft mode. vs AR = pooled speedup: our AR's time for the same tokens over the cell's, "
             "all prompts together (what a user waiting on the workload sees); beside it the per-prompt ratios' "
             "median and range; prefill excluded; width = W of a drafter, the lookup width for lookup, tree nodes "
             "for medusa:", "",
             "| draft | dtype | T | accept | width | L | tokens/step (pooled) | decode tok/s | our AR tok/s "
             "| mlx-lm tok/s | llama.cpp tok/s | vs AR (pooled) | median | per-prompt range | vs mlx-lm "
             "| vs llama.cpp | ids = AR |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for b in sorted(meta["best"], key=lambda b: (b["dtype"], b["temperature"], b.get("accept", ""),
                                                 -b["speedup_vs_ar"])):
        width = cell_width(b)
        extras = [f"{name} {b[k]}" for k, name in (("answers_width", "answers"), ("drafter_vocab", "head rows"),
                                                          ("lookup_max_length", "copies up to"))
                  if b.get(k)]
        draft = b["draft"] + (f" ({', '.join(extras)})" if extras else "")
        lines.append(
            f"| {draft} | {b['dtype']} | {b['temperature']:g} | {b.get('accept', 'greedy')} | {width} "
            f"| {b['beam_length']} | "
            f"{b['tokens_per_step']:.2f} | {b['decode_tokens_per_s']:.1f} | {b['ar_decode_tokens_per_s']:.1f} | "
            f"{_f(b.get('mlx_lm_decode_tokens_per_s'), '.1f')} | {_f(b.get('llama_cpp_decode_tokens_per_s'), '.1f')} | "
            f"{b['speedup_vs_ar']:.2f}x | "
            f"{_f(b.get('speedup_vs_ar_median'), '.2f')}x | {_f(b.get('speedup_vs_ar_min'), '.2f')}-"
            f"{_f(b.get('speedup_vs_ar_max'), '.2f')}x | "
            f"{_f(b.get('speedup_vs_mlx_lm'), '.2f')}x | {_f(b.get('speedup_vs_llama_cpp'), '.2f')}x | "
            f"{100 * b['equal_ar']:.0f}% |")
    for s in meta["summary"]:
        if s["decoder"] in BASELINE_NAMES:
            lines += ["", f"{BASELINE_NAMES[s['decoder']]} ids vs ours ({s['dtype']}, T={s['temperature']:g}): "
                          f"{100 * s['equal_ar']:.0f}% of prompts identical, common prefix {100 * s['match_ar']:.1f}% "
                          "of the length on average."]
    if any(s["decoder"] == "llama_cpp" for s in meta["summary"]):
        lines += ["", "llama.cpp (llama-cpp-python, the same GGUF, greedy, the machine's cores) multiplies the "
                      "quantized weights by 8-bit quantized activations, so its answers drift from ours after a few "
                      "dozen tokens; its tokens/s are over its own answers."]
    files = meta.get("files", {})
    lines += ["", "Files: " + ", ".join(f"[{k}]({v})" for k, v in files.items()), ""]
    p = meta.get("profile")
    if p:
        total = sum(p["phase_ms_per_step"].values()) + p["loop_ms_per_step"]
        lines += [f"Step profile of `{p['config']}` ({p['dtype']}), prompt {p['prompt_id']}, {p['steps']} steps, "
                  f"{p['tokens_per_step']:.2f} tokens/step (each phase evaluated at its boundary, so it runs a little "
                  f"slower than the sweep):", "", "| phase | ms per step | share |", "|---|---|---|"]
        for k, v in [*p["phase_ms_per_step"].items(), ("loop (emit, sources, stats)", p["loop_ms_per_step"])]:
            lines.append(f"| {k} | {v:.2f} | {100 * v / total if total else 0:.0f}% |")
        lines.append("")
    return "\n".join(lines)


BEGIN = "<!-- latest sweep: begin (rewritten by `python -m bench sweep`; the rest of this file is kept) -->"
END = "<!-- latest sweep: end -->"


def write_readme(path: Path, meta: dict[str, Any]) -> None:
    """README.md of the results folder (atomically), by `write_section`."""
    write_section(path, readme(meta))


def write_section(path: Path, generated: str) -> None:
    """Write a generated README (its first line a title) as the section between the BEGIN and END lines of the
    file at `path`; whatever else the file holds (a hand-kept index of runs) stays as it is. A file without those
    lines gets the section appended; a new file, the title and the section."""
    title, _, body = generated.partition("\n")
    section = f"{BEGIN}\n{body.strip()}\n{END}\n"
    old = path.read_text() if path.exists() else ""
    if BEGIN in old and END in old:
        text = old[: old.index(BEGIN)] + section + old[old.index(END) + len(END):].lstrip("\n")
    elif old.strip():
        text = old.rstrip("\n") + "\n\n## Latest sweep\n\n" + section
    else:
        text = f"{title}\n\n{section}"
    write_atomic(path, text)
