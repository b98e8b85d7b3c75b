"""`redrafter-mlx bench` and `redrafter-mlx tune` (the `bench` package is imported only when they run)."""

from __future__ import annotations

from pathlib import Path

import typer

from .errors import UserError

MODEL_HELP = "Target model (default: embedded SmolLM2-135M)."
DRAFTER_HELP = "Drafter: 'default' (shipped for the model), a directory, or random:SEED (smoke runs)."


def _ints(text: str, flag: str) -> list[int]:
    try:
        vals = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise UserError(f"{flag} takes comma-separated integers, e.g. 1,2,4 (got {text!r})") from None
    if not vals:
        raise UserError(f"{flag} is empty")
    return vals


def _dtypes(text: str | None) -> list[str]:
    from .loader import DTYPE_CHOICES

    vals = [x.strip() for x in (text or "auto").split(",") if x.strip()]
    bad = [v for v in vals if v not in DTYPE_CHOICES]
    if bad or not vals:
        raise UserError(f"--dtypes: unknown {', '.join(bad) or '(empty)'}; choose from {', '.join(DTYPE_CHOICES)}")
    return list(dict.fromkeys(vals))


def _fail(msg: str) -> None:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(2)


def bench(
    device: str = typer.Option(..., "--device", help="Label of this machine: results go to bench/results/LABEL/."),
    quick: bool = typer.Option(False, "--quick", help="3 prompts, 64 tokens, W in 1,4 x L in 3,5 (minutes)."),
    prompts_file: Path | None = typer.Option(None, help="JSONL prompts (MT-bench 'turns' or 'prompt')."),
    widths: str | None = typer.Option(None, help="Beam widths, comma-separated [1,2,3,4,8]."),
    lengths: str | None = typer.Option(None, help="Beam lengths, comma-separated [2,3,4,5,6]."),
    dtypes: str | None = typer.Option(None, help="Comma-separated: auto (float32 on CPU, quantized/float16 "
                                                    "on GPU), float32, float16, bfloat16, quantized [auto]."),
    max_tokens: int | None = typer.Option(None, "--max-tokens", "-n", help="New tokens per prompt [128]."),
    num_prompts: int | None = typer.Option(None, help="Prompts, spread over the file [8]; 80 = all MT-bench."),
    repeats: int | None = typer.Option(None, help="Timed repeats per (prompt, config); median kept [1]."),
    model: str | None = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    drafter: str = typer.Option("default", help=DRAFTER_HELP),
    no_mlx_lm: bool = typer.Option(False, "--no-mlx-lm", help="Skip the mlx-lm AR baseline."),
    no_profile: bool = typer.Option(False, "--no-profile", help="Skip the timing-ledger profile of the best cell."),
    out_dir: Path | None = typer.Option(None, help="Results root [bench/results]."),
) -> None:
    """Sweep beam width x length (x dtype) vs AR and mlx-lm; write CSV, JSON, plots and README.md."""
    try:
        from bench.harness import SweepSpec
        from bench.run import QUICK, RESULTS_DIR, run_bench

        base = QUICK if quick else {"num_prompts": 8, "max_tokens": 128, "widths": [1, 2, 3, 4, 8],
                                    "lengths": [2, 3, 4, 5, 6], "repeats": 1}
        spec = SweepSpec(
            model=model, drafter=drafter, dtypes=_dtypes(dtypes),
            widths=_ints(widths, "--widths") if widths else base["widths"],
            lengths=_ints(lengths, "--lengths") if lengths else base["lengths"],
            max_tokens=max_tokens or base["max_tokens"], repeats=repeats or base["repeats"], mlx_lm=not no_mlx_lm,
        )
        res = run_bench(device, spec, prompts_file, num_prompts or base["num_prompts"],
                        out_root=out_dir or RESULTS_DIR, profile=not no_profile)
        prof = res["meta"].get("profile")
        if prof:
            typer.echo(f"\ntiming ledger ({prof['dtype']} W={prof['beam_width']} L={prof['beam_length']}):")
            typer.echo(prof["table"])
        typer.echo("")
        for dtype, b in sorted(res["best"].items()):
            typer.echo(f"best {dtype}: W={b['beam_width']} L={b['beam_length']} {b['tokens_per_step']:.2f} tok/step "
                       f"{b['decode_tokens_per_s']:.1f} tok/s = {b['speedup_vs_ar']:.2f}x AR "
                       f"({b['ar_decode_tokens_per_s']:.1f}), {b['speedup_vs_mlx_lm']:.2f}x mlx-lm "
                       f"({b['mlx_lm_decode_tokens_per_s']:.1f})")
        typer.echo(f"results: {res['dir']}/ ({', '.join(res['files'].values())}, README.md)")
    except UserError as e:
        _fail(str(e))


def tune(
    model: str | None = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    drafter: str = typer.Option("default", help=DRAFTER_HELP),
    widths: str = typer.Option("1,2,4", help="Beam widths to try."),
    lengths: str = typer.Option("3,4,5", help="Beam lengths to try."),
    dtypes: str | None = typer.Option(None, help="dtypes to try, comma-separated [auto]."),
    max_tokens: int = typer.Option(64, "--max-tokens", "-n", help="New tokens per prompt."),
    num_prompts: int = typer.Option(3, help="MT-bench prompts to measure on."),
    prompts_file: Path | None = typer.Option(None, help="JSONL prompts instead of MT-bench."),
    repeats: int = typer.Option(1, help="Timed repeats per (prompt, config)."),
    min_speedup: float = typer.Option(1.03, help="A cell must beat AR by this factor to be chosen."),
) -> None:
    """Find the fastest beam shape (or plain AR) for this machine + model + drafter and remember it."""
    try:
        from bench.harness import SweepSpec
        from bench.tune import run_tune

        spec = SweepSpec(model=model, drafter=drafter, dtypes=_dtypes(dtypes), widths=_ints(widths, "--widths"),
                         lengths=_ints(lengths, "--lengths"), max_tokens=max_tokens, repeats=repeats,
                         mlx_lm=False, warmup_tokens=min(16, max_tokens), device="tune")
        entry, path = run_tune(spec, prompts_file, num_prompts, min_speedup)
        if entry["decision"] == "ar":
            bc = entry.get("best_cell") or {}
            typer.echo(f"no beam shape beat AR (best {bc.get('beam_width')}x{bc.get('beam_length')}: "
                       f"{bc.get('speedup_vs_ar', float('nan')):.2f}x); generate/chat will decode plain AR "
                       f"({entry['dtype']}, {entry['decode_tokens_per_s']:.1f} tok/s)")
        else:
            typer.echo(f"tuned: W={entry['beam_width']} L={entry['beam_length']} {entry['dtype']} "
                       f"{entry['decode_tokens_per_s']:.1f} tok/s = {entry['speedup_vs_ar']:.2f}x AR")
        typer.echo(f"saved to {path}")
    except UserError as e:
        _fail(str(e))


def register(app: typer.Typer) -> None:
    """Add the bench and tune commands to the CLI."""
    app.command()(bench)
    app.command()(tune)
