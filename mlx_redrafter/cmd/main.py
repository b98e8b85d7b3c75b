"""`redrafter-mlx`: the command-line entry point. It runs the app (cmd/app.py), whose commands install the optimized
BLAS once their options have parsed and before they import mlx.core (`common.installs_blas`): `--help` and usage
errors never load MLX."""

from __future__ import annotations

import sys

import typer

from mlx_redrafter.errors import UserError
from mlx_redrafter.system.blas import check_switches


def main() -> None:
    """Console entry point: usage errors and bad input end with one `error:` line and status 2."""
    try:
        check_switches()  # a bad REDRAFTER_* switch is an error even for --help (nothing is loaded for that)
        from mlx_redrafter.cmd.app import app
        from mlx_redrafter.cmd.common import run_app

        sys.exit(run_app(app, None, "redrafter-mlx"))
    except UserError as e:  # the BLAS switches, and errors raised outside a command's own handler
        typer.echo(f"error: {e}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
