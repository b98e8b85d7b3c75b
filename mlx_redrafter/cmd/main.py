"""`redrafter-mlx`: the command-line entry point. It installs the optimized BLAS before any command imports
mlx.core, then runs the app (cmd/app.py)."""

from __future__ import annotations

import sys

import typer

from mlx_redrafter import install_blas
from mlx_redrafter.errors import UserError


def main() -> None:
    """Console entry point: usage errors and bad input end with one `error:` line and status 2."""
    try:
        install_blas()  # an unknown REDRAFTER_BLAS / REDRAFTER_SMALL_GEMM value is a UserError
        from mlx_redrafter.cmd.app import app
        from mlx_redrafter.cmd.common import run_app

        sys.exit(run_app(app, None, "redrafter-mlx"))
    except UserError as e:  # the BLAS switches, and errors raised outside a command's own handler
        typer.echo(f"error: {e}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
