"""What every command shares: the error exit, and the decoding / sampling options."""

from __future__ import annotations

import contextlib
import functools
import inspect
import signal
from collections.abc import Callable, Iterator
from typing import Any

import typer

from mlx_redrafter import install_blas
from mlx_redrafter.defaults import (
    DEFAULT_ANSWERS_WIDTH,
    DEFAULT_BEAM_LENGTH,
    DEFAULT_BEAM_WIDTH,
    DEFAULT_DRAFT_CONFIDENCE,
    DEFAULT_DRAFTER_VOCAB,
    DEFAULT_LOOKUP_MAX_LENGTH,
    DEFAULT_LOOKUP_WIDTH,
)
from mlx_redrafter.draft import modes
from mlx_redrafter.draft.modes import MODES
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


@contextlib.contextmanager
def stops_cleanly() -> Iterator[None]:
    """For long background work (the data job's workers): Ctrl-C and SIGTERM raise KeyboardInterrupt, so the work
    saves what it finished and the command exits with status 130, and later ones are ignored while it does. A shell
    starts the background commands of a script (`make distill`'s workers) with Ctrl-C ignored; without this they
    kept running after the make that started them had stopped. The previous handlers come back afterwards."""

    def stop(signum: int, frame: Any) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def installs_blas(fn: Callable[..., Any]) -> Callable[..., Any]:
    """For `redrafter-mlx`'s commands: install the optimized BLAS (`install_blas`) once the command's options have
    parsed and before it imports MLX, so that `--help` and usage errors never load it."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            install_blas()
        except UserError as e:
            fail(str(e))
        return fn(*args, **kwargs)

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


MAX_LIST_VALUES = 100_000  # values one range of `int_list` may hold (shard indices, widths, layers)


def int_list(text: str, flag: str) -> list[int]:
    """Comma-separated integers or inclusive ranges, e.g. "1,2,4" or "0,10-16"; a one-line UserError otherwise."""
    vals: set[int] = set()
    if not text.strip():
        raise UserError(f"{flag} is empty")
    try:
        for part in (x.strip() for x in text.split(",")):
            lo, sep, hi = part.partition("-") if not part.startswith("-") else (part, "", "")
            if sep and int(hi) < int(lo):
                raise ValueError(part)
            if sep and int(hi) - int(lo) >= MAX_LIST_VALUES:
                raise UserError(f"{flag}: the range {part} holds more than {MAX_LIST_VALUES:,} values; give a "
                                "shorter one")
            vals.update(range(int(lo), int(hi) + 1) if sep else [int(part)])  # an empty item: int('') fails
    except ValueError:
        raise UserError(f"{flag} takes comma-separated integers or ranges, e.g. 1,2,4 or 0,10-16 (got {text!r})"
                        ) from None
    return sorted(vals)


PENALTY_HELP = {  # mlx-lm's penalties (sampling.PENALTIES), what each does to the tokens of its window
    "repetition": "Divide a positive logit by this (> 1 discourages), multiply a negative one, for every token",
    "presence": "Subtract this (-2 to 2) from the logit of every token",
    "frequency": "Subtract this (-2 to 2) from a token's logit once per time it occurs",
}


def _penalty_flags() -> dict[str, tuple[Any, Any]]:
    """--KIND-penalty and --KIND-context-size for each of mlx-lm's penalties."""
    flags: dict[str, tuple[Any, Any]] = {}
    for kind, what in PENALTY_HELP.items():
        flags[f"{kind}_penalty"] = (float | None, typer.Option(None, f"--{kind}-penalty", help=(
            f"{what} in the last --{kind}-context-size tokens (the prompt included; exact under speculation) "
            "\\[0: off].")))
        flags[f"{kind}_context_size"] = (int | None, typer.Option(None, f"--{kind}-context-size", help=(
            f"Tokens the {kind} penalty looks back \\[20].")))
    return flags


# Decoding flags shared by generate, chat and serve: name -> (type, option). None = not given: the tuned entry or
# the default applies (`tuning.resolve`), so every default is in one place (options.py, defaults.py).
DECODE_FLAGS: dict[str, tuple[Any, Any]] = {
    "draft": (str | None, typer.Option(None, "--draft", help=(
        "Drafting: auto (the drafter's own kind: lookup-else-rnn for a ReDrafter, lookup without a drafter), "
        + ", ".join(f"{m.name} ({m.help})" for m in MODES.values()) + " \\[tuned, else auto]."))),
    "no_draft": (bool, typer.Option(False, "--no-draft", help="Plain autoregressive decoding (= --draft none).")),
    "beam_width": (int | None, typer.Option(None, "--beam-width", "-w", help=(
        f"W: candidates of the drafter \\[tuned, else {DEFAULT_BEAM_WIDTH}]."))),
    "beam_length": (int | None, typer.Option(None, "--beam-length", "-l", help=(
        f"L: candidate length incl. the first token \\[tuned, else {DEFAULT_BEAM_LENGTH}]."))),
    "lookup_width": (int | None, typer.Option(None, "--lookup-width", help=(
        f"Candidates copied from the context \\[tuned, else {DEFAULT_LOOKUP_WIDTH}]."))),
    "lookup": (str | None, typer.Option(None, "--lookup", help=(
        "Lookup index: ngram (prompt lookup, n = 4..1), ngram2 (n = 4..2), suffix (suffix automaton), suffix2 "
        "(matches of >= 2 tokens) \\[the draft mode's: ngram2 for lookup-else-rnn, else ngram]."))),
    "lookup_max_length": (int | None, typer.Option(None, "--lookup-max-length", help=(
        "With lookup: a copy that keeps being accepted doubles, up to this many tokens incl. the first "
        f"(<= --beam-length: no growth) \\[{DEFAULT_LOOKUP_MAX_LENGTH}]."))),
    "answers_width": (int | None, typer.Option(None, "--answers-width", help=(
        "With lookup: candidates from the model's answer table where the context has nothing to copy (where a "
        f"table is shipped; 0 = off) \\[{DEFAULT_ANSWERS_WIDTH}]."))),
    "drafter_vocab": (int | None, typer.Option(None, "--drafter-vocab", help=(
        "ReDrafter: draft from only the N most frequent tokens of its head (exact either way; 0 = all) "
        f"\\[{DEFAULT_DRAFTER_VOCAB} where the head is frequency-ordered and larger, else all]."))),
    "draft_confidence": (float | None, typer.Option(None, "--draft-confidence", help=(
        "ReDrafter at width 1: end a draft where the drafter's probability of it falls below this (its drafts "
        "are calibrated: that probability is about how often the target accepts them; exact either way; 0 = "
        f"full length) \\[{DEFAULT_DRAFT_CONFIDENCE}]."))),
    "medusa_tree": (str | None, typer.Option(None, "--medusa-tree", help=(
        "Medusa's static tree: cpu (7 nodes), mc_sim_7b_63, or NAME:N (its first N nodes) \\[cpu]."))),
    "temp": (float | None, typer.Option(None, "--temp", help="Sampling temperature (0 = greedy) \\[0].")),
    "top_p": (float | None, typer.Option(None, "--top-p", help=(
        "Nucleus sampling: keep the top tokens holding this much mass \\[1]."))),
    "top_k": (int | None, typer.Option(None, "--top-k", help="Keep the k most likely tokens (0 = off) \\[0].")),
    "min_p": (float | None, typer.Option(None, "--min-p", help=(
        "Drop tokens below min_p x the top token's probability \\[0]."))),
    "seed": (int | None, typer.Option(None, "--seed", help="Random seed (same seed, same text).")),
    "logit_bias": (str | None, typer.Option(None, "--logit-bias", help=(
        "Add a bias to tokens' logits before every choice, greedy included, as ID=BIAS,ID=BIAS (-100 bans a "
        "token, +100 all but forces it; exact under speculation) \\[none]."))),
    **_penalty_flags(),
    "json_schema": (str | None, typer.Option(None, "--json-schema", help=(
        "Structured output: the answer follows this JSON schema, given as JSON text or a file holding it "
        "('{\"type\": \"object\"}': any JSON object; exact under speculation) \\[none]."))),
    "accept": (str | None, typer.Option(None, "--accept", help=(
        "Speculative acceptance at T > 0: exact (the target's distribution) or typical (Medusa's, faster, not "
        "exact) \\[exact]."))),
    "typical_eps": (float | None, typer.Option(None, "--typical-eps", help=(
        "Typical acceptance: posterior threshold eps \\[0.09]."))),
    "typical_delta": (float | None, typer.Option(None, "--typical-delta", help=(
        "Typical acceptance: entropy factor delta \\[0.3]."))),
}


def with_decode_flags(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Give a command the shared decoding flags (`DECODE_FLAGS`); it receives them as one dict, `flags`, by flat
    option name (None where not given; --no-draft folded into draft)."""
    sig = inspect.signature(fn, eval_str=True)
    own = [p for p in sig.parameters.values() if p.name != "flags"]
    extra = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=opt, annotation=kind)
             for name, (kind, opt) in DECODE_FLAGS.items()]

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        flags = {name: kwargs.pop(name) for name in DECODE_FLAGS}
        if flags.pop("no_draft"):
            if flags["draft"] is not None and modes.drafts(flags["draft"]):
                raise UserError(f"--no-draft and --draft {flags['draft']} contradict each other: give one")
            flags["draft"] = modes.NO_DRAFT
        return fn(*args, flags=flags, **kwargs)

    wrapper.__signature__ = sig.replace(parameters=[*own, *extra])
    return wrapper


def resolve_options(model: str | None, drafter: str, dtype: str, flags: dict[str, Any], **command: Any):
    """Decoding options for a command: its flags over the tuned entry over the defaults (`tuning.Resolved`), with
    the command's own options (e.g. its max_tokens) applied on top."""
    from mlx_redrafter import tuning

    res = tuning.resolve(model, drafter, flags, dtype)
    res.options = res.options.updated(**command)
    res.options.check()
    return res


def load_model(model: str | None, drafter: str, res: Any) -> Any:
    """The target (and the drafter its resolved mode wants) for a decoding command; a mode the loaded drafter
    cannot serve fails here, before any output, naming the tuned settings file when the mode came from it."""
    from mlx_redrafter import api, tuning

    lm = api.load(model, drafter if modes.wants_drafter(res.options.draft) else "none", res.dtype)
    asked_by = None
    if res.origin.get("draft") == "tuned":
        asked_by = f"draft {res.options.draft} from the tuned settings file {tuning.tuned_file()}"
    modes.resolve(res.options.draft, lm.drafter_kind, lm.target.name, lm.drafter_name, asked_by)
    return lm


def decoding_notes(lm: Any, res: Any) -> list[str]:
    """One-line notes on how decoding will run that a user would not guess: drafting by lookup because no drafter
    was found for `auto`, a tuned plain-AR entry overridden by a drafting flag, a dtype that is slow on a CPU."""
    import mlx.core as mx

    from mlx_redrafter.models.loader import SLOW_ON_CPU

    notes = list(res.notes)
    if res.options.draft == modes.AUTO and lm.drafter is None:
        notes.append(f"no drafter for {lm.target.name}: --draft auto drafts by lookup (copying from the context)")
    dtype = lm.target.dtype
    if dtype in SLOW_ON_CPU and mx.default_device() == mx.cpu:
        notes.append(f"{dtype} decodes {SLOW_ON_CPU[dtype]} slower than float32 on a CPU backend (MLX's CPU kernels "
                     "for it skip the BLAS): --dtype auto (float32) is the fast choice where the model fits in memory "
                     "as float32")
    return notes


def shape_text(s: dict) -> str:
    """The draft shape of `api.settings` as ' W=.. L=.. lookup-W=..' (the parts that apply)."""
    return "".join(f" {label}={s[key]}" for key, label in (("beam_width", "W"), ("beam_length", "L"),
                                                           ("lookup_width", "lookup-W")) if s.get(key))


def banner(lm: Any, res: Any) -> str:
    """One line: what decodes, with which settings and where each came from."""
    from mlx_redrafter import api

    s = api.settings(lm, res.options)
    shape = shape_text(s)
    origin = ", ".join(f"{k}: {v}" for k, v in sorted(res.origin.items()) if k != "max_tokens") or "defaults"
    return (f"model={s['model']} dtype={s['dtype']} draft={s['draft']}{shape} drafter={s['drafter']} "
            f"blas={s['blas']} (settings: {origin})")
