"""`redrafter-mlx distill`, `train` and `eval-drafter`: grow the distillation corpus, train and measure a drafter."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from . import common as c

DEFAULT_CORPUS = Path("data/corpus")
DEFAULT_FEATURES = Path(".cache/features")


@c.one_line_errors
def distill(
    prompts: Path = typer.Option(Path("../shared/data/train_prompts.jsonl"), help="JSONL prompts ({\"prompt\", "
                                 "\"source\"} per line)."),
    corpus: Path = typer.Option(DEFAULT_CORPUS, help="Corpus root; shards go to CORPUS/<model>/."),
    model: str | None = typer.Option(None, "--model", "-m", help=c.MODEL_HELP),
    shards: int | None = typer.Option(None, help="Stop after this many new shards (default: the whole plan)."),
    hours: float | None = typer.Option(None, help="Stop starting new shards after this many hours."),
    features: Path = typer.Option(DEFAULT_FEATURES, help="Local cache for the hidden states computed while "
                                  "generating (derived data, not committed)."),
    threads: int = typer.Option(1, help="BLAS threads (1 is right when other work shares the cores)."),
    nice: int = typer.Option(19, help="Scheduling niceness added to this process (0 = none)."),
) -> None:
    """Extend the distillation corpus: the target's greedy answers to the next prompts of the plan.

    Resumable (finished shards are kept; a corrupt one is regenerated), batched, float32. Run it in the
    background; stop it any time (Ctrl-C, kill): at most the shard in progress is lost.
    """
    import os

    from ..blas import set_threads
    from ..loader import load_target
    from ..train.corpus import build

    if nice:
        os.nice(nice)
    set_threads(threads)
    target = load_target(model, "float32")
    root = corpus / target.name
    out = build(target, prompts, root, max_shards=shards, hours=hours, features_dir=features / target.name)
    typer.echo(json.dumps(out.stats()))


@c.one_line_errors
def train() -> None:
    """Train a drafter on the distillation corpus (being rebuilt)."""
    from ..errors import UserError

    raise UserError("train is being rebuilt")


@c.one_line_errors
def eval_drafter(
    drafter: str = typer.Option("default", help=c.DRAFTER_HELP),
    model: str | None = typer.Option(None, "--model", "-m", help=c.MODEL_HELP),
    widths: str = typer.Option("1,2,4", help="Beam widths W, comma-separated."),
    lengths: str = typer.Option("2,3,4,5", help="Beam lengths L (first token + drafts), comma-separated."),
    num_prompts: int = typer.Option(80, help="Prompts to use (from the start of the file)."),
    max_tokens: int = typer.Option(128, help="New tokens per prompt (greedy)."),
    prompts: Path | None = typer.Option(None, help="Prompts JSONL [MT-bench first turns shipped in the package]."),
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON."),
) -> None:
    """Acceptance of a drafter: tokens per target call and accepted-length histogram per W x L (greedy, fp32)."""
    from ..train.evaluate import format_eval, run_eval

    res = run_eval(drafter, model, c.int_list(widths, "--widths"), c.int_list(lengths, "--lengths"), num_prompts,
                   max_tokens, prompts)
    typer.echo(json.dumps(res) if as_json else format_eval(res))
