"""Running a converter's typer app as `main(argv) -> int`, with every failure as one `error: ...` line."""

from __future__ import annotations

import typer

if hasattr(typer, "TyperException"):  # typer >= 0.26 vendors click; its usage errors derive from this
    _USAGE_ERROR: type[Exception] = typer.TyperException
else:  # pragma: no cover  (typer < 0.26 runs on click)
    import click

    _USAGE_ERROR = click.ClickException


def run(app: typer.Typer, argv: list[str] | None, prog: str) -> int:
    """Run `app` on `argv` (None: sys.argv[1:]); returns the exit status (0 ok, 2 bad input, 130 interrupted).

    Command errors arrive as `typer.Exit(2)` from `mlx_redrafter.cmd.common.fail`; usage errors (unknown option,
    bad value, missing argument) are printed as one `error: ...` line too, instead of a usage block."""
    command = typer.main.get_command(app)
    try:
        rc = command.main(args=argv, prog_name=prog, standalone_mode=False)
    except _USAGE_ERROR as e:
        typer.echo(f"error: {e.format_message()} (see {prog} --help)", err=True)
        return 2
    except typer.Abort:
        typer.echo("error: interrupted", err=True)
        return 130
    return rc if isinstance(rc, int) else 0
