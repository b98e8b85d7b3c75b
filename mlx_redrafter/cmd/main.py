"""`redrafter-mlx`: the command-line entry point. It installs the optimized BLAS before any command imports
mlx.core, then runs the app (cmd/app.py)."""

from __future__ import annotations

import sys

import typer

from mlx_redrafter import install_blas
from mlx_redrafter.errors import UserError


def main() -> None:
    """Console entry point: usage errors and bad input end with one `error:` line and status 2."""
    install_blas()
    from mlx_redrafter.cmd.app import app
    from mlx_redrafter.cmd.common import run_app

    try:
        sys.exit(run_app(app, None, "redrafter-mlx"))
    except UserError as e:  # safety net for errors raised outside a command's own handler
        typer.echo(f"error: {e}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
