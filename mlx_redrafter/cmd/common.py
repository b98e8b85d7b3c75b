"""What every command shares: the error exit, and the decoding / sampling options."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import typer

from mlx_redrafter.defaults import (
    DEFAULT_ANSWERS_WIDTH,
    DEFAULT_BEAM_LENGTH,
    DEFAULT_DRAFTER_VOCAB,
    DEFAULT_LOOKUP_MAX_LENGTH,
)
from mlx_redrafter.errors import UserError

MODEL_HELP = ("Target: a .gguf file, an mlx-lm directory, a Hugging Face repo id or an alias (default: embedded "
              "SmolLM2-135M).")
DRAFTER_HELP = "Drafter: 'default' (shipped for the model), 'none', a directory, or random:SEED[:EXIT_DIM]."
DTYPE_HELP = ("float32 | float16 | bfloat16 | quantized | auto (auto = float32 on a CPU backend, quantized/float16 "
              "on GPU).")


def fail(msg: str) -> None:
    """Print one `error: ...` line on stderr and exit with status 2."""
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(2)


def one_line_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator for commands: a UserError becomes one `error:` line and exit status 2 (never a traceback)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except UserError as e:
            fail(str(e))

    return wrapper


if hasattr(typer, "TyperException"):  # typer >= 0.26 vendors click; its usage errors derive from this
    _USAGE_ERROR: type[Exception] = typer.TyperException
else:  # pragma: no cover  (typer < 0.26 runs on click)
    import click

    _USAGE_ERROR = click.ClickException


def run_app(app: typer.Typer, argv: list[str] | None, prog: str) -> int:
    """Run `app` on `argv` (None: sys.argv[1:]); returns the exit status (0 ok, 2 bad input, 130 interrupted).

    Command errors arrive as `typer.Exit(2)` from `fail`; usage errors (unknown option,
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


def int_list(text: str, flag: str) -> list[int]:
    """Comma-separated integers, e.g. "1,2,4"; a one-line UserError otherwise."""
    try:
        vals = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise UserError(f"{flag} takes comma-separated integers, e.g. 1,2,4 (got {text!r})") from None
    if not vals:
        raise UserError(f"{flag} is empty")
    return vals


# Decoding flags shared by generate / chat (None = not given: tuned entry or default applies).
Draft = typer.Option(None, "--draft", help="Drafting: auto (the drafter's own kind: lookup-else-rnn for a "
                                           "ReDrafter, else lookup without one), rnn, lookup, rnn+lookup, "
                                           "lookup-else-rnn (the drafter only where lookup finds nothing), medusa, "
                                           "semi_ar, none "
                                           "\\[tuned, else auto].")
MedusaTree = typer.Option(None, "--medusa-tree", help="Medusa's static tree: cpu (7 nodes), mc_sim_7b_63, or NAME:N "
                                                      "(its first N nodes) \\[cpu].")
NoDraft = typer.Option(False, "--no-draft", help="Plain autoregressive decoding (= --draft none).")
BeamWidth = typer.Option(None, "--beam-width", "-w", help="W: candidates of the recurrent drafter \\[tuned, else 1].")
BeamLength = typer.Option(None, "--beam-length", "-l",
                          help=f"L: candidate length incl. the first token \\[tuned, else {DEFAULT_BEAM_LENGTH}].")
LookupWidth = typer.Option(None, "--lookup-width", help="Candidates copied from the context \\[tuned, else 1].")
AnswersWidth = typer.Option(DEFAULT_ANSWERS_WIDTH, "--answers-width",
                            help="With lookup: candidates copied from the model's own answers to other prompts "
                                 "in steps where the context has nothing to copy (where a table is shipped; "
                                 "0 = off) \\[0].")
DrafterVocab = typer.Option(None, "--drafter-vocab",
                            help="Recurrent drafter: draft from only the N most frequent tokens of its head (a "
                                 f"cheaper head; exact either way; 0 = all) \\[{DEFAULT_DRAFTER_VOCAB} where the "
                                 "head is frequency-ordered and larger, else all].")
LookupMaxLength = typer.Option(DEFAULT_LOOKUP_MAX_LENGTH, "--lookup-max-length",
                               help="With lookup: after a step that accepted every copied token, the next copy may "
                                    "be twice as long, up to this many tokens incl. the first (<= --beam-length: "
                                    f"copies keep the beam length) \\[{DEFAULT_LOOKUP_MAX_LENGTH}].")
Lookup = typer.Option("ngram", "--lookup", help="Lookup index: ngram (prompt lookup, n = 4..1), ngram2 (n = 4..2), "
                                                "suffix (suffix automaton), suffix2 (matches of >= 2 tokens).")
Temp = typer.Option(0.0, "--temp", help="Sampling temperature (0 = greedy).")
TopP = typer.Option(1.0, "--top-p", help="Nucleus sampling: keep the top tokens holding this much mass.")
TopK = typer.Option(0, "--top-k", help="Keep the k most likely tokens (0 = off).")
MinP = typer.Option(0.0, "--min-p", help="Drop tokens below min_p x the top token's probability.")
Seed = typer.Option(None, "--seed", help="Random seed (same seed, same text).")
Accept = typer.Option("exact", "--accept", help="Speculative acceptance at T > 0: exact (the target's distribution) "
                                                "or typical (Medusa's, faster, not exact).")
TypicalEps = typer.Option(0.09, "--typical-eps", help="Typical acceptance: posterior threshold eps.")
TypicalDelta = typer.Option(0.3, "--typical-delta", help="Typical acceptance: entropy factor delta.")


def decode_flags(draft: str | None, no_draft: bool, beam_width: int | None, beam_length: int | None,
                 lookup_width: int | None, medusa_tree: str | None = None) -> dict[str, Any]:
    """The decoding flags the user gave (None where not given)."""
    return {"draft": "none" if no_draft else draft, "beam_width": beam_width, "beam_length": beam_length,
            "lookup_width": lookup_width, "medusa_tree": medusa_tree}
