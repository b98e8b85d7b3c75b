"""`python -m bench sweep|parity|ablate` (run from the repository root; bench/ is a repo tool, not installed)."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx_redrafter  # noqa: F401  (loads the optimized BLAS before mlx.core)

# isort: split
import typer

from mlx_redrafter.cmd import common as c
from mlx_redrafter.defaults import BENCH_GRID, QUICK_GRID
from mlx_redrafter.errors import UserError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Benchmarks and the MLX vs PyTorch parity report of redrafter-mlx.")


def _csv(vals: list) -> str:
    return ",".join(map(str, vals))


def _grid(g: dict) -> str:
    return (f"{g['num_prompts']} prompts x {g['max_tokens']} tokens, widths {_csv(g['widths'])} x lengths "
            f"{_csv(g['lengths'])}")


def float_list(text: str, flag: str) -> list[float]:
    """Comma-separated numbers >= 0, e.g. "0,0.7"; a one-line UserError otherwise."""
    try:
        vals = sorted({float(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise UserError(f"{flag} takes comma-separated numbers, e.g. 0,0.7 (got {text!r})") from None
    if not vals or vals[0] < 0:
        raise UserError(f"{flag} needs numbers >= 0 (got {text!r})")
    return vals


@app.command()
@c.one_line_errors
def sweep(
    device: str = typer.Option(..., help="Label of this machine: results go to OUT_DIR/DEVICE/."),
    quick: bool = typer.Option(False, "--quick", help=f"The small grid: {_grid(QUICK_GRID)}."),
    widths: str | None = typer.Option(None, help="W for rnn modes, lookup width for lookup; comma-separated "
                                                 f"(default {_csv(BENCH_GRID['widths'])})."),
    lengths: str | None = typer.Option(None, help="Candidate lengths L incl. the first token, comma-separated "
                                                  f"(default {_csv(BENCH_GRID['lengths'])})."),
    drafts: str | None = typer.Option(None, help="Draft modes: comma list of rnn, lookup, rnn+lookup (default: "
                                                 "all three with a drafter, else lookup)."),
    dtypes: str = typer.Option("auto", help="Comma-separated dtypes. " + c.DTYPE_HELP),
    max_tokens: int | None = typer.Option(None, help=f"New tokens per prompt (default {BENCH_GRID['max_tokens']})."),
    num_prompts: int | None = typer.Option(None, help="Prompts, spread over the file "
                                                      f"(default {BENCH_GRID['num_prompts']})."),
    prompts_file: Path | None = typer.Option(None, help="JSONL prompts (default: MT-bench first turns, packaged)."),
    repeats: int | None = typer.Option(None, help=f"Timed repeats, median kept (default {BENCH_GRID['repeats']})."),
    model: str | None = typer.Option(None, "--model", "-m", help=c.MODEL_HELP),
    drafter: str = typer.Option("default", help=c.DRAFTER_HELP),
    mlx_lm: bool = typer.Option(True, "--mlx-lm/--no-mlx-lm", help="Measure mlx-lm's AR as a second baseline."),
    profile: bool = typer.Option(True, "--profile/--no-profile", help="Profile the best cell's step phases "
                                                                      "after the sweep."),
    temperatures: str = typer.Option("0", help="Comma-separated sampling temperatures (0 = greedy)."),
    out_dir: Path = typer.Option(Path(__file__).resolve().parent / "results", help="Results root."),
) -> None:
    """The full benchmark: draft modes x widths x lengths vs our AR and mlx-lm's AR, interleaved per prompt."""
    from .run import BenchSpec, run_bench

    grid = QUICK_GRID if quick else BENCH_GRID
    spec = BenchSpec(
        device=device, model=model, drafter=drafter, drafts=drafts,
        dtypes=[d.strip() for d in dtypes.split(",") if d.strip()],
        temperatures=float_list(temperatures, "--temperatures"),
        widths=c.int_list(widths, "--widths") if widths else list(grid["widths"]),
        lengths=c.int_list(lengths, "--lengths") if lengths else list(grid["lengths"]),
        max_tokens=grid["max_tokens"] if max_tokens is None else max_tokens,
        num_prompts=grid["num_prompts"] if num_prompts is None else num_prompts, prompts_file=prompts_file,
        repeats=grid["repeats"] if repeats is None else repeats, mlx_lm=mlx_lm, profile=profile)
    res = run_bench(spec, out_dir, progress=True)
    typer.echo(f"wrote {res['dir']}: " + ", ".join(res["files"].values()) + ", README.md")
    if not res["quiet"]:
        typer.echo("the machine was NOT quiet during the run: see the warning above and README.md", err=True)


@app.command()
@c.one_line_errors
def parity(
    device: str = typer.Option("cpu", help="PyTorch device of the reference path: cpu or cuda."),
    model: str | None = typer.Option(None, "--model", "-m", help=c.MODEL_HELP),
    drafter: str | None = typer.Option(None, help="Drafter: the shipped one if any, else random:0; or a path."),
    prompts: int = typer.Option(4, help="Number of MT-bench first turns."),
    max_tokens: int = typer.Option(32, help="New tokens per prompt in the end-to-end comparison."),
    beam_width: int = typer.Option(4, help="W."),
    beam_length: int = typer.Option(5, help="L (first token included)."),
    out_dir: Path | None = typer.Option(None, help="Output folder (default bench/results/parity/DEVICE)."),
) -> None:
    """MLX vs PyTorch/transformers parity report -> parity.json and parity.md."""
    if device not in ("cpu", "cuda"):
        raise UserError(f"--device must be cpu or cuda (got {device!r})")
    try:
        import torch  # noqa: F401
    except ImportError:
        raise UserError("the parity report needs PyTorch: run `make parity` (installs the torch extra)") from None
    from .parity import RESULTS_DIR, markdown, run

    out = out_dir or RESULTS_DIR / device
    report = run(device, model, drafter, prompts, max_tokens, beam_width, beam_length, out,
                 log=lambda m: typer.echo(m, err=True))
    typer.echo(markdown(report))
    typer.echo(f"wrote {out / 'parity.json'} and {out / 'parity.md'}")


@app.command()
@c.one_line_errors
def ablate(
    variants: str = typer.Option("base", help="Comma-separated variant names (see bench/ablate.py VARIANTS), or "
                                              "'all'."),
    corpus: Path = typer.Option(Path("data/corpus/smollm2-135m"), help="Corpus directory."),
    features: Path = typer.Option(Path(".cache/features/smollm2-135m"), help="Feature cache."),
    runs: Path = typer.Option(Path("runs/ablation"), help="Run directories (resumable)."),
    device: str = typer.Option("cpu", help="Results go to bench/results/DEVICE/."),
    steps: int = typer.Option(2000, help="Optimizer steps of every variant (one budget for all)."),
    eval_prompts: int = typer.Option(24, help="Held-out prompts decoded per variant."),
    eval_tokens: int = typer.Option(128, help="New tokens per held-out prompt."),
) -> None:
    """Drafter recipe ablations (labels, size, draft vocab, T, regularisation, corpus size) on one held-out slice."""
    from .ablate import VARIANTS, run_ablation

    names = list(VARIANTS) if variants == "all" else [v.strip() for v in variants.split(",") if v.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise UserError(f"unknown variant(s) {', '.join(unknown)}: choose from {', '.join(VARIANTS)}")
    out = Path(__file__).resolve().parent / "results" / device
    run_ablation(names, corpus, features, runs, out, {"steps": steps}, eval_prompts, eval_tokens,
                 [(1, 4), (4, 4)], log=lambda m: typer.echo(m, err=True))
    typer.echo(f"wrote {out / 'drafter-ablation.md'}")


def main() -> None:
    """Entry point of `python -m bench`."""
    try:
        sys.exit(c.run_app(app, None, "python -m bench"))
    except UserError as e:  # raised outside a command's own handler
        typer.echo(f"error: {e}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
