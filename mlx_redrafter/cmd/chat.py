"""`redrafter-mlx chat`: an interactive chat with streaming speculative decoding (a thin UI over ChatSession)."""

from __future__ import annotations

import signal
import sys
import typing
from types import FrameType

import typer

from mlx_redrafter.cmd import common as c
from mlx_redrafter.errors import UserError

# What /set changes: the decoding flags (by their flat names, with the type their flag parses) and the answer length.
SETTABLE: dict[str, type] = {
    **{name: next(t for t in typing.get_args(kind) if t is not type(None))
       for name, (kind, _) in c.DECODE_FLAGS.items() if name != "no_draft"},
    "temperature": float, "max_tokens": int,
}

HELP = """commands:
  /stats   speed, tokens per target call, acceptance by draft source, prefill tokens of the last turn
  /reset   start a new conversation (the system prompt stays)
  /set NAME VALUE
           change a decoding option for the next answers, by its flag's name: /set temp 0.7, /set draft lookup,
           /set beam-length 5, /set max-tokens 200, /set seed 3; /set system TEXT starts a new conversation with
           that system prompt; /set json-schema FILE|JSON makes answers follow a JSON schema (none: free text
           again); /set alone shows the settings and the names
  /help    this help
  /quit    quit (also: empty line, Ctrl-D, Ctrl-C at the prompt)
Ctrl-C while an answer streams stops that answer; the conversation goes on."""


class AnswerInterrupt:
    """While an answer streams: the first Ctrl-C asks it to stop after the current step, a second one raises
    KeyboardInterrupt at once (e.g. during a long prefill)."""

    def __init__(self) -> None:
        self.hit = False

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self.hit:
            raise KeyboardInterrupt
        self.hit = True

    def __enter__(self) -> AnswerInterrupt:
        self.hit = False
        self.previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGINT, self.previous)


def _read(prompt: str) -> str | None:
    """One line from the user; None means quit (Ctrl-D, Ctrl-C, empty line, /quit)."""
    try:
        line = input(prompt)
    except (EOFError, KeyboardInterrupt):
        sys.stdout.write("\n")
        return None
    line = line.strip()
    return None if line in ("", "/quit", "/exit") else line


def _set(session, args: str) -> str:
    """Apply `/set NAME VALUE` (or `/set system TEXT`) to the session; returns what to show. A bad name or value
    is a one-line UserError that changes nothing."""
    name, _, value = args.strip().partition(" ")
    key, value = name.lstrip("-").replace("-", "_"), value.strip()
    if not name:
        return f"settings: {_settings(session)}\nnames: {', '.join(n.replace('_', '-') for n in SETTABLE)}, system"
    if key == "system":
        session.set_system(value or None)
        return "[system prompt set; new conversation]" if value else "[the template's system prompt; new conversation]"
    if key == "json_schema" and value:  # the rest of the line: a file, or JSON text with spaces
        off = value.lower() in ("none", "off")
        session.set_json_schema(None if off else value)
        return f"[{'answers in free text' if off else 'answers follow the JSON schema'}] {_settings(session)}"
    if key not in SETTABLE:
        raise UserError(f"/set {name}: unknown option; /set alone lists the names")
    if not value or " " in value:
        raise UserError(f"/set {name} needs one value, e.g. /set {name} {_example(SETTABLE[key])}")
    kind = SETTABLE[key]
    try:
        parsed = kind(value)
    except ValueError:
        raise UserError(f"/set {name}: {value!r} is not {'an integer' if kind is int else 'a number'}") from None
    session.set_options(**{key: parsed})
    return f"[{name} = {value}] {_settings(session)}"


def _example(kind: type) -> str:
    return {int: "3", float: "0.7"}.get(kind, "lookup")


def _settings(session) -> str:
    """The decoding settings the next answer uses, on one line."""
    from mlx_redrafter import api

    s, o = api.settings(session.lm, session.options), session.options
    shape = c.shape_text(s)
    sampling = " ".join(f"{k}={v}" for k, v in o.sampling.as_dict().items())
    system = "the template's" if session.system is None else repr(session.system[:40])
    schema = " json-schema=on" if o.json_schema is not None else ""
    return f"draft={s['draft']}{shape} {sampling} max-tokens={o.max_tokens}{schema} system: {system}"


def _answer(session, line: str) -> bool:
    """Stream one answer to stdout; a short summary line goes to stderr. False when the line was refused (its
    `error:` line printed)."""
    from mlx_redrafter.errors import UserError

    before = session.last
    with AnswerInterrupt() as intr:
        answer = session.send(line, stop=lambda: intr.hit)
        try:
            for piece in answer:
                sys.stdout.write(piece)
                sys.stdout.flush()
        except KeyboardInterrupt:
            pass
        except UserError as e:
            typer.echo(f"error: {e}", err=True)
            return False
        finally:
            answer.close()  # ends the answer now, whatever stopped it: the session records it consistently
    t = session.last
    sys.stdout.write("\n")
    if t is before:  # stopped before the answer began
        typer.echo("[stopped]", err=True)
        return True
    if t.dropped_turns:
        typer.echo(f"[context full: dropped the {t.dropped_turns} oldest turn(s) and re-read the rest]", err=True)
    stopped = " - answer stopped" if t.stop == "interrupted" else ""
    typer.echo(f"[{len(t.tokens)} tokens, {t.stats.decode_tokens_per_s:.1f} tok/s, {t.stats.tokens_per_step:.2f} "
               f"tokens/call, prefill {t.prefill_tokens} tokens{stopped}]", err=True)
    return True


@c.one_line_errors
@c.with_decode_flags
def chat(
    model: str | None = typer.Option(None, "--model", "-m", help=c.MODEL_HELP),
    drafter: str = typer.Option("default", help=c.DRAFTER_HELP),
    max_tokens: int = typer.Option(512, "--max-tokens", "-n", help="Most new tokens per answer."),
    dtype: str = typer.Option("auto", help=c.DTYPE_HELP),
    system: str | None = typer.Option(None, "--system", "-s", help="System prompt (default: the template's)."),
    template: str = typer.Option("own", help="Chat template: own (the model's; Vicuna's for Vicuna models), "
                                             "vicuna, chatml, or a .jinja file."),
    max_context: int | None = typer.Option(None, "--max-context", help="Most tokens the conversation keeps; older "
                                           "turns are dropped beyond it (default: the model's context)."),
    *,
    flags: dict,
) -> None:
    """Interactive chat with streaming output and KV-cache reuse across turns. /help lists the commands."""
    from mlx_redrafter.chat import ChatSession
    from mlx_redrafter.models.templates import load_template_option

    res = c.resolve_options(model, drafter, dtype, flags, max_tokens=max_tokens)
    custom = None if template == "own" else load_template_option(template)
    if sys.stderr.isatty():
        typer.echo("loading model...", err=True)
    lm = c.load_model(model, drafter, res)
    tok = lm.tokenizer
    if custom is not None:
        tok.set_template(custom, f"--template {template}")
    session = ChatSession(lm, res.options, system=system, max_context=max_context)
    typer.echo(f"{c.banner(lm, res)}, template: {tok.template_source}", err=True)
    for note in c.decoding_notes(lm, res):
        typer.echo(f"note: {note}", err=True)
    if not tok.chat_template:
        typer.echo("note: the model has no chat template: prompts are plain text (try --template vicuna)", err=True)
    typer.echo("Type a message; /help for commands; empty line, Ctrl-D or Ctrl-C quits.", err=True)
    interactive = sys.stdin.isatty()  # at a terminal a refused line can be retyped; piped input cannot
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
    while (line := _read(">>> ")) is not None:
        if line == "/help":
            typer.echo(HELP)
        elif line == "/reset":
            session.reset()
            typer.echo("[new conversation]")
        elif line == "/stats":
            typer.echo(session.stats_text())
        elif line == "/set" or line.startswith("/set "):
            try:
                typer.echo(_set(session, line[4:]))
            except UserError as e:
                typer.echo(f"error: {e}", err=True)
                if not interactive:
                    raise typer.Exit(2) from None
        elif line.startswith("/") and " " not in line:
            typer.echo(f"unknown command {line}; /help lists the commands")
        elif not _answer(session, line) and not interactive:
            raise typer.Exit(2)  # piped input: a refused line ends the run, as bad input does in every command
