"""`redrafter-mlx tune`: find the fastest decoding settings (or plain AR) for this machine and remember them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from mlx_redrafter.cmd import common as c
from mlx_redrafter.defaults import TUNE_GRID, TUNE_MIN_SPEEDUP, TUNE_MIN_TOKENS_PER_STEP
from mlx_redrafter.errors import UserError
from mlx_redrafter.schema import Field, check_option


@c.one_line_errors
def tune(
    model: str | None = typer.Option(None, "--model", "-m", help=c.MODEL_HELP),
    drafter: str = typer.Option("default", help=c.DRAFTER_HELP),
    drafts: str | None = typer.Option(None, help="Draft modes to try, comma-separated: rnn, lookup, rnn+lookup, "
                                                 "lookup-else-rnn, medusa, semi_ar (default: lookup and the "
                                                 "drafter's own modes)."),
    widths: str = typer.Option(",".join(map(str, TUNE_GRID["widths"])),
                               help="Widths: W for rnn modes, lookup width for lookup; comma-separated."),
    lengths: str = typer.Option(",".join(map(str, TUNE_GRID["lengths"])),
                                help="Candidate lengths L (first token included), comma-separated."),
    dtypes: str = typer.Option("auto", help="Comma-separated dtypes to compare. " + c.DTYPE_HELP),
    num_prompts: int = typer.Option(TUNE_GRID["num_prompts"], help="Prompts, spread over the prompts file."),
    prompts_file: Path | None = typer.Option(None, help="JSONL prompts (default: MT-bench first turns, packaged)."),
    max_tokens: int = typer.Option(TUNE_GRID["max_tokens"], "--max-tokens", "-n", help="New tokens per prompt."),
    repeats: int = typer.Option(TUNE_GRID["repeats"], help="Timed repeats per prompt and setting (median kept)."),
    min_speedup: float = typer.Option(TUNE_MIN_SPEEDUP, help="A setting must beat AR by this factor to be stored."),
    force: bool = typer.Option(False, "--force", help="Store the result even if other processes kept the machine "
                                                      "busy (timings then do not describe this machine)."),
    as_json: bool = typer.Option(False, "--json", help="Print the stored entry as JSON."),
) -> None:
    """Measure draft modes x widths x lengths against AR on a few prompts and store the winner for this machine,
    model and drafter; generate/chat then use it. A setting must beat AR by --min-speedup and decide at least
    1.1 tokens per target call, else plain AR is stored."""
    from mlx_redrafter import api, sweep, tuning
    from mlx_redrafter.models.loader import DTYPE_CHOICES
    from mlx_redrafter.prompts import first_turns
    from mlx_redrafter.system.machine_state import machine_now

    grid_w, grid_l = c.int_list(widths, "--widths"), c.int_list(lengths, "--lengths")
    dtype_list = [d.strip() for d in dtypes.split(",") if d.strip()]
    if not dtype_list:
        raise UserError("--dtypes is empty")
    if max_tokens < 2:
        raise UserError(f"--max-tokens must be >= 2 (got {max_tokens})")
    check_option("--min-speedup", min_speedup, Field("", float, positive=True))
    check_option("--num-prompts", num_prompts, Field("", int, 1, 100_000))
    check_option("--repeats", repeats, Field("", int, 1, 1_000))
    for d in dtype_list:
        check_option("--dtypes", d, Field("", str, choices=DTYPE_CHOICES))
    sweep.parse_drafts(drafts)  # bad input fails now, not after loading the model
    sweep.check_shapes(grid_w, grid_l, max_tokens=max_tokens)
    tuning.read_all()  # a corrupt tuned file too, not after the measurement
    prompts = first_turns(prompts_file, num_prompts, spread=True)
    now = machine_now()
    if not now["quiet"] and not force:
        _refuse(now["reasons"])
    rows: list[dict[str, Any]] = []
    states: list[dict[str, Any]] = []
    for dtype in dtype_list:
        lm = api.load(model, drafter, dtype)
        modes = sweep.sweep_drafts(drafts, lm.drafter_kind)
        configs = sweep.grid_configs(modes, grid_w, grid_l, max_tokens)
        res = sweep.sweep(lm, prompts, configs, repeats, progress=sweep.print_progress)
        rows += res.rows
        states.append(res.machine_state)
        del lm
    quiet = all(s["quiet"] for s in states)
    if not quiet and not force:
        _refuse([r for s in states for r in s["reasons"]])
    summary = sweep.summarize(rows)
    entry = sweep.decide(summary, min_speedup, TUNE_MIN_TOKENS_PER_STEP)
    entry["settings"] = {"drafts": sorted({s["draft"] for s in summary if sweep.is_cell(s)}), "widths": grid_w,
                         "lengths": grid_l, "dtypes": sorted({r["dtype"] for r in rows}), "num_prompts": len(prompts),
                         "max_tokens": max_tokens, "repeats": repeats, "min_speedup": min_speedup,
                         "min_tokens_per_step": TUNE_MIN_TOKENS_PER_STEP}
    entry["cells"] = [{k: s[k] for k in ("config", "dtype", "speedup_vs_ar", "tokens_per_step",
                                         "decode_tokens_per_s")} for s in summary]
    entry["machine_state"] = {"quiet": quiet, "forced": force and not quiet,
                              "reasons": [r for s in states for r in s["reasons"]],
                              "loadavg_before": states[0]["before"]["loadavg"],
                              "loadavg_after": states[-1]["after"]["loadavg"]}
    path = tuning.store(model, drafter, entry)
    if as_json:
        typer.echo(json.dumps(entry))
        return
    typer.echo(_table(summary))
    what = "plain AR (no setting beat it)" if entry["decision"] == "ar" else (
        f"{entry['config']} ({entry['dtype']}): {entry['speedup_vs_ar']:.2f}x AR, "
        f"{entry['tokens_per_step']:.2f} tokens per target call")
    typer.echo(f"stored: {what} -> {path}")


def _refuse(reasons: list[str]) -> None:
    raise UserError("the machine is busy, so timings would not describe it (" + "; ".join(reasons) + "): stop "
                    "those processes and re-run, or pass --force to store the result anyway")


def _table(summary: list[dict[str, Any]]) -> str:
    """The measured settings as a plain-text table, fastest first."""
    lines = [f"{'setting':<22} {'dtype':<9} {'tok/step':>8} {'tok/s':>7} {'vs AR':>6} {'ids = AR':>8}"]
    for s in sorted(summary, key=lambda s: -s["decode_tokens_per_s"]):
        lines.append(f"{s['config']:<22} {s['dtype']:<9} {s['tokens_per_step']:>8.2f} "
                     f"{s['decode_tokens_per_s']:>7.1f} {s['speedup_vs_ar']:>5.2f}x {100 * s['equal_ar']:>7.0f}%")
    return "\n".join(lines)
