"""`redrafter-mlx chat`: an interactive chat with streaming speculative decoding."""

from __future__ import annotations

import sys

import typer

from . import common as c


@c.one_line_errors
def chat(
    model: str | None = typer.Option(None, "--model", "-m", help=c.MODEL_HELP),
    drafter: str = typer.Option("default", help=c.DRAFTER_HELP),
    draft: str | None = c.Draft,
    no_draft: bool = c.NoDraft,
    beam_width: int | None = c.BeamWidth,
    beam_length: int | None = c.BeamLength,
    lookup_width: int | None = c.LookupWidth,
    max_tokens: int = typer.Option(512, "--max-tokens", "-n", help="Most new tokens per answer."),
    dtype: str = typer.Option("auto", help=c.DTYPE_HELP),
) -> None:
    """Interactive chat with streaming output. Empty line or Ctrl-D quits."""
    from .. import api, tuning
    from ..generate import Stats

    res = tuning.resolve(model, drafter, c.decode_flags(draft, no_draft, beam_width, beam_length, lookup_width),
                         dtype, api.DecodeOptions(max_tokens=max_tokens))
    res.options.check()
    typer.echo("loading model...", err=True)
    runner = api.load(model, drafter, res.dtype)
    s = api.settings(runner, res.options)
    typer.echo(f"model={s['model']} dtype={s['dtype']} draft={s['draft']} drafter={s['drafter']} "
               f"W={s['beam_width']} L={s['beam_length']} ({res.source} settings). Type a message; empty line or "
               f"Ctrl-D quits.", err=True)
    messages: list[dict[str, str]] = []
    try:
        while True:
            try:
                line = input(">>> ")
            except EOFError:
                break
            if not line.strip():
                break
            messages.append({"role": "user", "content": line})
            ids = runner.tokenizer.encode_chat(messages)
            stats, reply = Stats(), []
            for piece, _ in api.stream_generate(runner, ids, res.options, stats=stats):
                sys.stdout.write(piece)
                sys.stdout.flush()
                reply.append(piece)
            messages.append({"role": "assistant", "content": "".join(reply)})
            typer.echo(f"\n[{stats.decode_tokens_per_s:.1f} tok/s, {stats.tokens_per_step:.2f} tokens/step]", err=True)
    except KeyboardInterrupt:
        pass
