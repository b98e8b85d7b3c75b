"""`redrafter-mlx serve`: an OpenAI-compatible server with speculative decoding (mlx_redrafter/server/)."""

from __future__ import annotations

import errno
import socket

import typer

from mlx_redrafter.cmd import common as c
from mlx_redrafter.errors import UserError


@c.one_line_errors
@c.with_decode_flags
def serve(
    model: str | None = typer.Option(None, "--model", "-m", help=c.MODEL_HELP),
    drafter: str = typer.Option("default", help=c.DRAFTER_HELP),
    dtype: str = typer.Option("auto", help=c.DTYPE_HELP),
    host: str = typer.Option("127.0.0.1", help="Address to bind (0.0.0.0 exposes the server to the network)."),
    port: int = typer.Option(8080, help="TCP port."),
    api_key: str | None = typer.Option(None, "--api-key", help="Require 'Authorization: Bearer KEY' on /v1/."),
    max_tokens: int = typer.Option(512, "--max-tokens", "-n", help="Default most new tokens per request."),
    max_active: int = typer.Option(4, help="Requests decoded at once (rows of one batch: one target call per step)."),
    max_queued: int = typer.Option(16, help="Requests waiting beyond those; more get 429 with Retry-After."),
    prompt_cache: int = typer.Option(4, help="KV caches of finished requests kept for follow-ups (LRU; 0 = off)."),
    *,
    flags: dict,
) -> None:
    """Serve the model over HTTP: OpenAI's /v1/chat/completions, /v1/completions and /v1/models, and a chat page
    at / that shows where each token came from. Request fields override the decoding flags given here."""
    import uvicorn

    from mlx_redrafter import api
    from mlx_redrafter.server.app import create_app
    from mlx_redrafter.server.scheduler import Scheduler

    if not 0 < port < 65536:
        raise UserError(f"--port must be from 1 to 65535 (got {port})")
    for name, value, lo in (("--max-active", max_active, 1), ("--max-queued", max_queued, 0),
                            ("--prompt-cache", prompt_cache, 0)):
        if not lo <= value <= 1024:
            raise UserError(f"{name} must be from {lo} to 1024 (got {value})")
    if api_key is not None and not api_key.strip():
        raise UserError("--api-key is empty: give the key clients must send, or leave the option out to serve "
                        "without one")
    check_address(host, port)  # before the model loads: a port in use fails in a moment, not after the load
    res = c.resolve_options(model, drafter, dtype, flags, max_tokens=max_tokens)
    lm = c.load_model(model, drafter, res)
    typer.echo(f"{c.banner(lm, res)}", err=True)
    for note in c.decoding_notes(lm, res):
        typer.echo(f"note: {note}", err=True)
    curve = api.cost_curve(lm, max_active, res.options.shape.length) if max_active > 1 else None
    scheduler = Scheduler(lm, max_active=max_active, max_queued=max_queued, cache_entries=prompt_cache, curve=curve)
    scheduler.start()
    app = create_app(lm, scheduler, res.options, api_key=api_key)
    typer.echo(f"serving {lm.target.name} on http://{host}:{port} (OpenAI API under /v1; a chat page at /)", err=True)
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning")
    finally:
        scheduler.stop()


def check_address(host: str, port: int) -> None:
    """A one-line UserError unless the server could listen on (host, port) now (as uvicorn binds it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except socket.gaierror as e:
        raise UserError(f"cannot serve on --host {host!r}: {e.strerror or e}") from None
    except OSError as e:
        hint = ": stop what uses it or pick another --port" if e.errno == errno.EADDRINUSE else ""
        raise UserError(f"cannot serve on {host}:{port}: {e.strerror or e}{hint}") from None
