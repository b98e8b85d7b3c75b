"""`redrafter-mlx tune`: find the fastest decoding settings (or plain AR) for this machine and remember them."""

from __future__ import annotations

import typer

from . import common as c


@c.one_line_errors
def tune(
    model: str | None = typer.Option(None, "--model", "-m", help=c.MODEL_HELP),
    drafter: str = typer.Option("default", help=c.DRAFTER_HELP),
) -> None:
    """Measure a small grid of decoding settings against AR and store the winner for generate/chat."""
    from ..errors import UserError

    raise UserError("tune is being rebuilt")
