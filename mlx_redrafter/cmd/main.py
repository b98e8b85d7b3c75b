"""`redrafter-mlx`: the command-line entry point (one typer app; each command lives in its own module)."""

from __future__ import annotations

import sys

import typer

from mlx_redrafter.cmd.chat import chat
from mlx_redrafter.cmd.common import run_app
from mlx_redrafter.cmd.generate import generate
from mlx_redrafter.cmd.quantize import quantize
from mlx_redrafter.cmd.train import answers, distill, eval_drafter, features, train
from mlx_redrafter.cmd.tune import tune
from mlx_redrafter.errors import UserError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Exact speculative decoding (ReDrafter + lookup drafting) in pure MLX.")
app.command()(generate)
app.command()(chat)
app.command()(tune)
app.command()(distill)
app.command()(features)
app.command()(answers)
app.command()(train)
app.command("eval-drafter")(eval_drafter)
app.command()(quantize)


def main() -> None:
    """Console entry point: usage errors and bad input end with one `error:` line and status 2."""
    try:
        sys.exit(run_app(app, None, "redrafter-mlx"))
    except UserError as e:  # safety net for errors raised outside a command's own handler
        typer.echo(f"error: {e}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
