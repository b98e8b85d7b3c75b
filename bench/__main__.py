"""`python -m bench sweep|parity|ablate|compare|...` (from the repo root; bench/ is a repo tool, not installed)."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from mlx_redrafter.cmd import common as c
from mlx_redrafter.defaults import (
    BENCH_GRID,
    DEFAULT_ANSWERS_WIDTH,
    DEFAULT_DRAFTER_VOCAB,
    DEFAULT_LOOKUP_MAX_LENGTH,
    QUICK_GRID,
)
from mlx_redrafter.errors import UserError
from mlx_redrafter.schema import Field, check_http_url, check_option

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


def warn_slow_dtypes(dtypes: list[str]) -> None:
    """One stderr line when a dtype that is slow on MLX's CPU backend is asked for on a CPU backend."""
    import mlx.core as mx

    from mlx_redrafter.models.loader import SLOW_ON_CPU

    slow = [d for d in dtypes if d in SLOW_ON_CPU]
    if slow and mx.default_device() == mx.cpu:
        typer.echo(f"warning: {', '.join(slow)} on a CPU backend: MLX's CPU float16 / bfloat16 matmuls skip BLAS and "
                   "run 6-25x slower than float32: expect a long run (see bench/README.md)", err=True)


def dtype_list(text: str) -> list[str]:
    """Comma-separated explicit dtypes (float32, float16, bfloat16, quantized); a one-line UserError otherwise."""
    names = [d.strip() for d in text.split(",") if d.strip()]
    if not names or any(d not in ("float32", "float16", "bfloat16", "quantized") for d in names):
        raise UserError(f"--dtypes takes float32, float16, bfloat16, quantized (got {text!r})")
    return names


@app.command()
@c.one_line_errors
def sweep(
    device: str = typer.Option(..., help="Label of this machine: results go to OUT_DIR/DEVICE/."),
    quick: bool = typer.Option(False, "--quick", help=f"The small grid: {_grid(QUICK_GRID)}."),
    widths: str | None = typer.Option(None, help="W for rnn modes, lookup width for lookup; comma-separated "
                                                 f"(default {_csv(BENCH_GRID['widths'])})."),
    lengths: str | None = typer.Option(None, help="Candidate lengths L incl. the first token, comma-separated "
                                                  f"(default {_csv(BENCH_GRID['lengths'])})."),
    answers_widths: str = typer.Option(str(DEFAULT_ANSWERS_WIDTH), help="Answer-table widths of the lookup modes, "
                                       "comma-separated (e.g. 0,1 to measure the table's effect)."),
    drafter_vocabs: str | None = typer.Option(None, help="Drafter head rows of the rnn modes, comma-separated "
                                              f"(0 = the whole head; e.g. 0,4096) [{DEFAULT_DRAFTER_VOCAB} where the "
                                              "head is frequency-ordered and larger, else all]."),
    lookup_max_lengths: str = typer.Option(str(DEFAULT_LOOKUP_MAX_LENGTH), help="Longest lookup copies of the lookup "
                                           "modes, comma-separated (e.g. 0,9: fixed-length copies vs growing)."),
    lookup_indexes: str = typer.Option("", help="Context indexes of the lookup modes (as --lookup of "
                                       "redrafter-mlx), comma-separated (e.g. ngram,ngram2) [each mode's own]."),
    drafts: str | None = typer.Option(None, help="Draft modes: comma list of rnn, lookup, rnn+lookup, lookup-else-rnn, "
                                                 "medusa, semi_ar (default: lookup and the drafter's own modes)."),
    dtypes: str = typer.Option("auto", help="Comma-separated dtypes. " + c.DTYPE_HELP),
    max_tokens: int | None = typer.Option(None, help=f"New tokens per prompt (default {BENCH_GRID['max_tokens']})."),
    num_prompts: int | None = typer.Option(None, help="Prompts, spread over the file "
                                                      f"(default {BENCH_GRID['num_prompts']})."),
    prompts_file: Path | None = typer.Option(None, help="JSONL prompts (default: MT-bench first turns, packaged)."),
    repeats: int | None = typer.Option(None, help=f"Timed repeats, median kept (default {BENCH_GRID['repeats']})."),
    model: str | None = typer.Option(None, "--model", "-m", help=c.MODEL_HELP),
    drafter: str = typer.Option("default", help=c.DRAFTER_HELP),
    mlx_lm: bool = typer.Option(True, "--mlx-lm/--no-mlx-lm", help="Measure mlx-lm's AR as a second baseline."),
    llama_cpp: bool | None = typer.Option(None, "--llama-cpp/--no-llama-cpp",
                                          help="Measure llama.cpp's AR on the same GGUF as a third baseline (default: "
                                               "where llama-cpp-python is installed, make .venv/.llama-cpp, and the "
                                               "model is a GGUF; greedy rows only)."),
    profile: bool = typer.Option(True, "--profile/--no-profile", help="Profile the best cell's step phases "
                                                                      "after the sweep."),
    temperatures: str = typer.Option("0", help="Comma-separated sampling temperatures (0 = greedy)."),
    accepts: str = typer.Option("exact", help="Acceptance rules at T > 0: exact, typical or exact,typical."),
    out_dir: Path = typer.Option(Path(__file__).resolve().parent / "results", help="Results root."),
) -> None:
    """The full benchmark: draft modes x widths x lengths vs our AR and mlx-lm's AR, interleaved per prompt."""
    from .run import BenchSpec, run_bench

    grid = QUICK_GRID if quick else BENCH_GRID
    spec = BenchSpec(
        device=device, model=model, drafter=drafter, drafts=drafts,
        dtypes=[d.strip() for d in dtypes.split(",") if d.strip()],
        temperatures=float_list(temperatures, "--temperatures"),
        accepts=[a.strip() for a in accepts.split(",") if a.strip()],
        widths=c.int_list(widths, "--widths") if widths else list(grid["widths"]),
        lengths=c.int_list(lengths, "--lengths") if lengths else list(grid["lengths"]),
        answers_widths=c.int_list(answers_widths, "--answers-widths"),
        drafter_vocabs=c.int_list(drafter_vocabs, "--drafter-vocabs") if drafter_vocabs else [None],
        lookup_max_lengths=c.int_list(lookup_max_lengths, "--lookup-max-lengths"),
        lookup_indexes=[x.strip() for x in lookup_indexes.split(",") if x.strip()] or [None],
        max_tokens=grid["max_tokens"] if max_tokens is None else max_tokens,
        num_prompts=grid["num_prompts"] if num_prompts is None else num_prompts, prompts_file=prompts_file,
        repeats=grid["repeats"] if repeats is None else repeats, mlx_lm=mlx_lm, llama_cpp=llama_cpp,
        profile=profile)
    warn_slow_dtypes(spec.dtypes)
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
    corpus: Path = typer.Option(Path("data/corpus"), help="Corpus root (the model's corpora live under it)."),
    features: Path = typer.Option(Path(".cache/features"), help="Feature cache root."),
    runs: Path = typer.Option(Path("runs/ablation"), help="Run directories (resumable)."),
    device: str = typer.Option("cpu-avx2", help="Results go to bench/results/DEVICE/."),
    cpu_minutes: float = typer.Option(20.0, help="Training CPU minutes of every variant (one budget for all)."),
    replay_sequences: int = typer.Option(128, help="Held-out greedy sequences replayed per variant."),
    eval_prompts: int = typer.Option(16, help="MT-bench first turns decoded per variant (0 = skip)."),
    eval_tokens: int = typer.Option(128, help="New tokens per sequence."),
) -> None:
    """Drafter recipe ablations at equal CPU time (labels, noise, head, size, T, data source and size)."""
    from .ablate import VARIANTS, run_ablation

    names = list(VARIANTS) if variants == "all" else [v.strip() for v in variants.split(",") if v.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise UserError(f"unknown variant(s) {', '.join(unknown)}: choose from {', '.join(VARIANTS)}")
    out = Path(__file__).resolve().parent / "results" / device
    run_ablation(names, corpus, features, runs, out, cpu_minutes, replay_sequences, eval_prompts, eval_tokens,
                 log=lambda m: typer.echo(m, err=True))
    typer.echo(f"wrote {out / 'drafter-ablation.md'}")


@app.command()
@c.one_line_errors
def engines(
    num_prompts: int = typer.Option(64, help="Prompts from the corpus plan's pool."),
    max_tokens: int = typer.Option(256, help="Most new tokens per answer."),
    batch: int = typer.Option(64, help="Generation batch size (as `make distill`)."),
    device: str = typer.Option("cpu-avx2", help="Results go to bench/results/DEVICE/."),
) -> None:
    """Tokens per CPU second of the two data engines: batched greedy generation vs the teacher-forced pass."""
    from .engines import measure, write

    out = Path(__file__).resolve().parent / "results" / device
    path = write(measure(num_prompts, max_tokens, batch, log=lambda m: typer.echo(m, err=True)), out)
    typer.echo(f"wrote {path}")


@app.command("dtype-agreement")
@c.one_line_errors
def dtype_agreement(
    dtypes: str = typer.Option("float32,bfloat16,float16,quantized", help="Comma-separated dtypes to run."),
    num_prompts: int = typer.Option(10, help="MT-bench first turns, spread over the categories."),
    max_tokens: int = typer.Option(64, help="New tokens per prompt."),
    quantized_prompts: int = typer.Option(2, help="Prompts for quantized (~4.5 s per token row on a CPU backend)."),
    quantized_tokens: int = typer.Option(16, help="New tokens per prompt for quantized."),
    calibrate: int = typer.Option(2, help="Prompts whose AR logits calibrate the tie bound (quantized: 1)."),
    calibrate_positions: int = typer.Option(32, help="AR positions per calibration prompt (quantized: <= 12)."),
    runs: str | None = typer.Option(None, help="Comma-separated runs (default: all five; quantized: three)."),
    calibrate_only: bool = typer.Option(False, "--calibrate-only", help="Only measure each dtype's rounding "
                                        "against float32 on the same weights (--calibrate prompts x "
                                        "--calibrate-positions tokens), then the report."),
    mlx_lm_only: bool = typer.Option(False, "--mlx-lm-only", help="Only compare our logits with mlx-lm's on the "
                                                                    "same weights (per dtype), then the report."),
    report_only: bool = typer.Option(False, "--report-only", help="Only rebuild agreement.json / README.md."),
    out_dir: Path = typer.Option(Path(__file__).resolve().parent / "results" / "cpu" / "dtype-agreement",
                                 help="Output folder."),
) -> None:
    """Speculative vs AR token agreement per dtype on the full model (tie-aware rule) -> OUT_DIR."""
    from .dtype_agreement import RUNS, calibrate_vs_float32, mlx_lm_check, run, write_report

    names = dtype_list(dtypes)
    picked = [r.strip() for r in runs.split(",") if r.strip()] if runs else None
    known = [r[0] for r in RUNS]
    if picked is not None and (not picked or any(r not in known for r in picked)):
        raise UserError(f"--runs takes a comma list of {', '.join(known)} (got {runs!r})")
    if min(num_prompts, max_tokens, quantized_prompts, quantized_tokens) < 1:
        raise UserError("--num-prompts, --max-tokens, --quantized-prompts and --quantized-tokens must be >= 1")
    warn_slow_dtypes(names)
    if calibrate_only:
        for d in names:
            calibrate_vs_float32(d, calibrate, calibrate_positions, out_dir, log=lambda m: typer.echo(m, err=True))
        write_report(out_dir)
    elif mlx_lm_only:
        mlx_lm_check(names, out_dir=out_dir, log=lambda m: typer.echo(m, err=True))
        write_report(out_dir)
    elif report_only:
        write_report(out_dir)
    else:
        run(names, num_prompts, max_tokens, quantized_prompts, quantized_tokens, calibrate, calibrate_positions,
            out_dir, picked, log=lambda m: typer.echo(m, err=True))
    typer.echo(f"wrote {out_dir / 'agreement.json'} and {out_dir / 'README.md'}")


@app.command("quant-layouts")
@c.one_line_errors
def quant_layouts(
    repeats: int = typer.Option(3, help="Timed repeats per N (median kept)."),
    slow_repeats: int = typer.Option(1, help="Repeats for float16-activation layouts (~4.5 s per token row)."),
    out_dir: Path = typer.Option(Path(__file__).resolve().parent / "results" / "cpu", help="Output folder."),
) -> None:
    """Quantized layouts (4 / 8 bits, groups 32 / 64 / 128, float32 / bfloat16 / float16 activations) vs float32
    on this backend: one forward over N = 1, 4, 8 tokens -> quant-layouts.{json,md}."""
    from .quant_layouts import run as run_layouts

    if min(repeats, slow_repeats) < 1:
        raise UserError("--repeats and --slow-repeats must be >= 1")
    warn_slow_dtypes(["float16", "bfloat16"])  # the layouts' MLX products with those activations
    run_layouts(repeats, slow_repeats, out_dir, log=lambda m: typer.echo(m, err=True))
    typer.echo(f"wrote {out_dir / 'quant-layouts.json'} and {out_dir / 'quant-layouts.md'}")


@app.command("drafter-quant")
@c.one_line_errors
def drafter_quant(
    num_prompts: int = typer.Option(12, help="MT-bench first turns (held out for the drafter)."),
    max_tokens: int = typer.Option(128, help="New tokens per prompt."),
    repeats: int = typer.Option(20, help="Beam-search micro-benchmark repeats (median kept)."),
    out_dir: Path = typer.Option(Path(__file__).resolve().parent / "results" / "cpu", help="Output folder."),
) -> None:
    """The shipped drafter quantized to 8 / 4 bits vs as shipped: acceptance and drafting time with the float32
    target -> quantized-drafter.{json,md}."""
    from .drafter_quant import run as run_drafter_quant

    if min(num_prompts, max_tokens, repeats) < 1:
        raise UserError("--num-prompts, --max-tokens and --repeats must be >= 1")
    run_drafter_quant(num_prompts, max_tokens, repeats, out_dir, log=lambda m: typer.echo(m, err=True))
    typer.echo(f"wrote {out_dir / 'quantized-drafter.json'} and {out_dir / 'quantized-drafter.md'}")


@app.command()
@c.one_line_errors
def memory(
    dtypes: str = typer.Option("float32,float16,quantized", help="Comma-separated dtypes."),
    out_dir: Path = typer.Option(Path(__file__).resolve().parent / "results" / "cpu", help="Output folder."),
) -> None:
    """Peak memory of target + drafter + scratch KV vs AR alone and vs mlx-lm, per dtype -> memory.{json,md}."""
    from .memory import run as run_memory

    names = dtype_list(dtypes)
    warn_slow_dtypes(names)
    report = run_memory(names, out_dir, log=lambda m: typer.echo(m, err=True))
    typer.echo((out_dir / "memory.md").read_text() if report else "")


@app.command()
@c.one_line_errors
def profile(
    device: str = typer.Option("cpu", help="Results go to bench/results/DEVICE/verify-profile.{json,md}."),
    ns: str = typer.Option("1,2,4,8,16", "--ns", help="Numbers of new tokens N, comma-separated."),
    repeats: int = typer.Option(15, help="Interleaved repeats (median kept)."),
    context: int = typer.Option(200, help="Tokens already in the KV cache."),
) -> None:
    """What the target's forward costs as the verified tokens N grow, with and without the small-GEMM path."""
    import json

    from mlx_redrafter.files import write_atomic
    from mlx_redrafter.models.loader import load_target
    from mlx_redrafter.system.blas import blas_name, small_gemm_disabled
    from mlx_redrafter.system.machine import machine_info
    from mlx_redrafter.system.machine_state import MachineWatch

    from .profile_verify import markdown
    from .profile_verify import profile as run_profile

    model = load_target(None, "float32").model
    Ns = c.int_list(ns, "--ns")
    if Ns[0] < 1 or context < 1 or repeats < 1:
        raise UserError("--ns, --context and --repeats must be >= 1")
    watch = MachineWatch()
    watch.start()
    res = {"blas": blas_name(), "small_gemm": run_profile(model, Ns, context, repeats)}
    with small_gemm_disabled():
        res["blas_only"] = run_profile(model, Ns, context, repeats)
    state = watch.stop()
    res.update(machine=machine_info(), machine_state=state)
    out = Path(__file__).resolve().parent / "results" / device
    quiet = "quiet" if state.get("quiet") else "NOT quiet (see machine_state in the JSON)"
    text = (markdown(res["small_gemm"], f"Verify-step profile, {res['blas']} ({quiet})") + "\n"
            + markdown(res["blas_only"], f"Same, every product on {res['blas'].split('+')[0]} (small-GEMM path off)"))
    write_atomic(out / "verify-profile.json", json.dumps(res, indent=1, default=str) + "\n")
    write_atomic(out / "verify-profile.md", text)
    typer.echo(text)


@app.command()
@c.one_line_errors
def compare(
    device: str = typer.Option("cpu", help="Reads and writes bench/results/DEVICE/."),
) -> None:
    """ReDrafter vs Medusa vs semi-AR vs lookup at their best cells, from the committed sweeps and the ablation
    -> drafter-comparison.{json,md}."""
    from .compare import markdown, write_comparison

    folder = Path(__file__).resolve().parent / "results" / device
    if not folder.is_dir():
        raise UserError(f"no results at {folder}: run `python -m bench sweep --device {device}` first")
    report = write_comparison(folder)
    if not report["rows"]:
        raise UserError(f"no sweeps with greedy float32 cells under {folder}: run the sweeps first "
                        "(see bench/README.md)")
    typer.echo(markdown(report))


@app.command()
@c.one_line_errors
def ab(
    drafter: list[str] = typer.Option(..., "--drafter", help="A drafter to compare (directory, or 'default' for the "
                                      "shipped one); repeat the option."),
    rounds: int = typer.Option(2, help="Passes over the prompts (the drafters' order rotates)."),
    per_set: int = typer.Option(8, help="Prompts per set: MT-bench first turns and each --heldout corpus'."),
    heldout: list[Path] = typer.Option([], "--heldout", help="A corpus whose held-out shard's first turns are a set "
                                       "(repeat the option)."),
    max_tokens: int = typer.Option(128, help="Tokens decoded per prompt."),
    out: Path = typer.Option(..., help="Folder for ab.json and ab.md."),
) -> None:
    """Speed A/B of drafters in one process, interleaved: AR, and per drafter the default mode and the drafter
    alone (pooled speed over AR; every output checked against AR's). Run it on a quiet machine."""
    from mlx_redrafter.files import check_writable_dir

    from .ab import markdown, run_ab, write_ab

    check_option("--rounds", rounds, Field("", int, 1, 100))
    check_option("--per-set", per_set, Field("", int, 1, 80))
    check_option("--max-tokens", max_tokens, Field("", int, 1, 4096))
    check_writable_dir(out, "--out")  # before the run, not after it
    report = run_ab(drafter, rounds, per_set, heldout, max_tokens)
    write_ab(out, report)
    typer.echo(markdown(report))


def main() -> None:
    """Entry point of `python -m bench`: installs the BLAS, then runs the command."""
    from mlx_redrafter import install_blas

    try:
        install_blas()  # before any command imports mlx.core; an unknown switch value is a UserError
        sys.exit(c.run_app(app, None, "python -m bench"))
    except UserError as e:  # the BLAS switches, and errors raised outside a command's own handler
        typer.echo(f"error: {e}", err=True)
        sys.exit(2)


@app.command()
@c.one_line_errors
def load(
    device: str = typer.Option(..., help="Label of this machine: results go to bench/results/DEVICE/server-load.*"),
    clients: str = typer.Option("1,2,4,8", help="Concurrency levels, comma-separated."),
    requests: int = typer.Option(2, help="Requests per client per level."),
    num_prompts: int = typer.Option(8, help="MT-bench first turns to cycle through."),
    max_tokens: int = typer.Option(64, help="Most new tokens per request."),
    max_seconds: float = typer.Option(1800, help="Stop after the level that passes this many seconds."),
    url: str | None = typer.Option(None, help="A running server (default: start one on 127.0.0.1)."),
) -> None:
    """K concurrent clients x M requests against `redrafter-mlx serve`, vs the same requests one at a time."""
    from mlx_redrafter.prompts import first_turns
    from mlx_redrafter.system.machine_state import machine_now

    from .load import run_load, start_server, write

    ks = c.int_list(clients, "--clients")
    if ks[0] < 1 or requests < 1 or max_tokens < 1 or num_prompts < 1:
        raise UserError("--clients, --requests, --max-tokens and --num-prompts must be >= 1")
    check_option("--max-seconds", max_seconds, Field("", float, hi=1e7, positive=True))
    if url is not None:
        url = check_http_url(url, "--url", "http://127.0.0.1:8080")
    prompts = [r["prompt"] for r in first_turns(None, num_prompts, spread=True)]
    proc = None
    if url is None:
        proc, url = start_server(["--max-active", str(max(ks))])
    try:
        before = machine_now()
        res = run_load(url, prompts, ks, requests, max_tokens, max_seconds,
                       log=lambda m: typer.echo(m, err=True))
        res["machine_state"] = {"before": before, "after": machine_now()}
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    quiet = "quiet machine" if res["machine_state"]["before"]["quiet"] else "NOT a quiet machine"
    out = Path(__file__).resolve().parent / "results" / device
    write(res, out, f"Server load test ({device}, {quiet})")
    typer.echo(f"wrote {out}/server-load.md", err=True)


@app.command()
@c.one_line_errors
def curve(
    device: str = typer.Option(..., help="Label of this machine: results go to bench/results/DEVICE/cost-curve.*"),
    batches: str = typer.Option("1,2,3,4,5,6,7,8", help="Batch sizes (rows), comma-separated."),
    max_tokens: int = typer.Option(9, help="Tokens per row: 1..N (9: the longest default context copy)."),
    context: int = typer.Option(128, help="Committed tokens per row."),
    repeats: int = typer.Option(5, help="Timed rounds over every cell, interleaved (the median is kept)."),
    keep: bool = typer.Option(True, "--keep/--no-keep", help="Also keep it as this machine's curve for batched "
                              "decoding of the embedded model."),
) -> None:
    """The cost of one batched target call per rows x tokens per row (what batched speculation spends)."""
    from mlx_redrafter.batch.budget import CostCurve, curve_file
    from mlx_redrafter.system.machine import fingerprint
    from mlx_redrafter.system.machine_state import MachineWatch

    from .batch import curve_markdown

    bs = c.int_list(batches, "--batches")
    if min(bs) < 1 or max(bs) > 64 or not 1 <= max_tokens <= 64 or not 1 <= context <= 4096 or repeats < 1:
        raise UserError("--batches 1..64, --max-tokens 1..64, --context 1..4096, --repeats >= 1")
    lm = api_load()
    watch = MachineWatch()  # waits for a load average left by finished work to decay; watches other processes
    watch.start()
    cv = CostCurve.measure(lm.target.model, bs, max_tokens, context, repeats,
                           progress=lambda r, n: typer.echo(f"curve: round {r}/{n} over every cell", err=True))
    state = watch.stop()
    cv.meta = {"model": lm.target.name, "machine": fingerprint(), "machine_state": state}
    out = Path(__file__).resolve().parent / "results" / device
    out.mkdir(parents=True, exist_ok=True)
    cv.save(out / "cost-curve.json")
    quiet = "quiet machine" if state["quiet"] else "NOT a quiet machine"
    (out / "cost-curve.md").write_text(f"# Batched target call cost ({device}, {quiet})\n\n" + curve_markdown(cv))
    if keep:
        cv.save(curve_file(lm.target.name, fingerprint()))
    typer.echo(curve_markdown(cv))


@app.command()
@c.one_line_errors
def batch(
    device: str = typer.Option(..., help="Label of this machine: results go to bench/results/DEVICE/batch-*"),
    batches: str = typer.Option("1,2,4,8", help="Batch sizes, comma-separated."),
    num_prompts: int = typer.Option(16, help="MT-bench first turns (spread over the categories)."),
    max_tokens: int = typer.Option(128, help="New tokens per prompt."),
    repeats: int = typer.Option(2, help="Interleaved repeats (median)."),
    draft: str = typer.Option("auto", help="Draft mode of the speculative system."),
    mlx_lm: bool = typer.Option(True, "--mlx-lm/--no-mlx-lm", help="Run mlx-lm's batch_generate too."),
) -> None:
    """Throughput per batch size: batched speculative vs our batched plain decoding vs mlx-lm's batch_generate."""
    import time as _time

    from mlx_redrafter import api as _api
    from mlx_redrafter.prompts import first_turns
    from mlx_redrafter.system.machine_state import MachineWatch

    from .batch import run, write

    bs = c.int_list(batches, "--batches")
    if min(bs) < 1 or max(bs) > 64 or num_prompts < 1 or max_tokens < 1 or repeats < 1:
        raise UserError("--batches 1..64; --num-prompts, --max-tokens, --repeats >= 1")
    _api.decode_options(draft=draft)  # an unknown mode fails now, not after the cost curve's measurement
    lm = api_load()
    prompts = [_api.encode_prompt(lm, r["prompt"]) for r in first_turns(None, num_prompts, spread=True)]
    curve = _api.cost_curve(lm, max(bs), _api.decode_options().copy_length)
    watch = MachineWatch()  # waits for a load average left by finished work to decay; watches other processes
    watch.start()
    res = run(lm, prompts, bs, max_tokens, repeats, mlx_lm, curve, draft, log=lambda m: typer.echo(m, err=True))
    res["machine_state"] = watch.stop()
    quiet = "quiet machine" if res["machine_state"]["quiet"] else "NOT a quiet machine"
    out = Path(__file__).resolve().parent / "results" / device
    stem = "batch-" + _time.strftime("%Y%m%d-%H%M%S")
    write(res, out, stem, f"Batched decoding ({device}, {quiet})")
    typer.echo((out / f"{stem}.md").read_text())


@app.command()
@c.one_line_errors
def calibration(
    device: str = typer.Option(..., help="Label of this machine: results go to bench/results/DEVICE/calibration.*"),
    num_prompts: int = typer.Option(24, help="MT-bench first turns (spread over the categories)."),
    max_tokens: int = typer.Option(128, help="Greedy tokens per answer."),
    length: int = typer.Option(6, help="L: drafts of L - 1 tokens from every answer position."),
) -> None:
    """How often the target accepts the drafter's drafts, by the drafter's own probability of them."""
    import json as _json

    from mlx_redrafter import api as _api
    from mlx_redrafter.files import write_atomic
    from mlx_redrafter.prompts import first_turns

    from .calibration import markdown, measure

    if num_prompts < 1 or max_tokens < 2 or not 2 <= length <= 16:
        raise UserError("--num-prompts >= 1, --max-tokens >= 2, --length 2..16")
    lm = api_load()
    if lm.drafter is None or lm.drafter_kind != "rnn":
        raise UserError("the embedded model has no ReDrafter drafter to calibrate")
    prompts = [_api.encode_prompt(lm, r["prompt"]) for r in first_turns(None, num_prompts, spread=True)]
    res = measure(lm, prompts, max_tokens, length, log=lambda m: typer.echo(m, err=True))
    out = Path(__file__).resolve().parent / "results" / device
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "calibration.json", _json.dumps(res, indent=1) + "\n")
    text = markdown(res, f"Drafter calibration ({device})")
    write_atomic(out / "calibration.md", text)
    typer.echo(text)


def api_load():
    """The embedded model (float32) with its shipped drafter."""
    from mlx_redrafter import api as _api

    return _api.load(None, "default", "float32")


if __name__ == "__main__":
    main()
