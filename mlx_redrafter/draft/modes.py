"""Draft modes as one table: which sources draft, in which order, which backs up which, and the drafter needed.

Everything that names a mode (the API, the CLI, chat, tuning, sweeps, reports) reads `MODES`; adding a mode is
one row. A row's sources are kinds of `sources.SOURCE_KINDS` in candidate order (a source that `backs_up` another
proposes only in steps where that one proposed nothing). `auto` is not a row: it is the mode whose `auto_for`
names the loaded drafter's kind ("none" without a drafter). A sweep (`redrafter-mlx tune`, `python -m bench sweep`)
measures by default the rows marked `swept` that the loaded drafter can serve.

A mode that needs a drafter, asked for by name while none is loaded, is an error (the same in every command):
a switch does what its name says. `auto` never is: it drafts with what there is.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlx_redrafter.defaults import DEFAULT_LOOKUP_INDEX
from mlx_redrafter.errors import UserError

AUTO = "auto"
NO_DRAFT = "none"  # the row of plain autoregressive decoding
DRAFTER_NAMES = {"rnn": "ReDrafter (rnn)", "medusa": "Medusa", "semi_ar": "semi-AR"}  # per drafter kind


@dataclass(frozen=True)
class Mode:
    """One way of drafting (see the module docstring)."""

    name: str
    sources: tuple[tuple[str, str | None], ...]  # (source kind, the source it backs up or None), candidate order
    drafter: str | None = None  # the drafter kind it needs: rnn, medusa, semi_ar
    auto_for: tuple[str, ...] = ()  # drafter kinds ("none": no drafter) for which `auto` is this mode
    width: str = "beam_width"  # the option a sweep's width sets: beam_width, lookup_width or medusa_tree (nodes)
    swept: bool = False  # measured by a sweep unless its modes are named (where its drafter kind is loaded)
    lookup_index: str = DEFAULT_LOOKUP_INDEX  # the context index it copies by unless --lookup names one
    help: str = ""

    def uses(self, kind: str) -> bool:
        """Whether a source of this kind drafts in this mode."""
        return any(k == kind for k, _ in self.sources)

    @property
    def drafts(self) -> bool:
        """False for plain autoregressive decoding."""
        return bool(self.sources)


MODES: dict[str, Mode] = {m.name: m for m in (
    Mode("rnn", (("rnn", None),), drafter="rnn", swept=True, help="the recurrent drafter (ReDrafter) every step"),
    Mode("lookup", (("lookup", None), ("answers", "lookup")), auto_for=("none",), width="lookup_width",
         swept=True, help="copies from the context (and the answer table, where it has nothing)"),
    Mode("rnn+lookup", (("rnn", None), ("lookup", None), ("answers", "lookup")), drafter="rnn", swept=True,
         help="both every step"),
    Mode("lookup-else-rnn", (("lookup", None), ("answers", "lookup"), ("rnn", "lookup")), drafter="rnn",
         auto_for=("rnn",), swept=True, lookup_index="ngram2",
         help="the drafter only in steps where lookup finds a match of two tokens or more to copy after"),
    Mode("medusa", (("medusa", None),), drafter="medusa", auto_for=("medusa",), width="medusa_tree",
         swept=True, help="a Medusa drafter's static tree"),
    Mode("semi_ar", (("semi_ar", None),), drafter="semi_ar", auto_for=("semi_ar",), swept=True,
         help="a semi-autoregressive drafter's beams"),
    Mode(NO_DRAFT, (), width="", help="plain autoregressive decoding"),
)}
CHOICES = (AUTO, *MODES)  # what --draft accepts


def check_mode(draft: str | Mode) -> None:
    """A one-line UserError unless `draft` is 'auto', a name in `MODES` or a `Mode`."""
    if not isinstance(draft, Mode) and draft not in CHOICES:
        raise UserError(f"--draft must be one of {', '.join(CHOICES)} (got {draft!r})")


def wants_drafter(draft: str | Mode) -> bool:
    """Whether decoding with `draft` would use a drafter if one is available ('auto' would)."""
    return draft == AUTO or get(draft).drafter is not None


def drafts(draft: str | Mode) -> bool:
    """Whether decoding with `draft` drafts at all ('auto' does: by lookup where there is no drafter)."""
    return draft == AUTO or get(draft).drafts


def swept(drafter_kind: str | None) -> list[Mode]:
    """The rows a sweep measures unless told which: those marked `swept` that need no drafter or this kind."""
    return [m for m in MODES.values() if m.swept and m.drafter in (None, drafter_kind)]


def get(draft: str | Mode) -> Mode:
    """The row of a mode name (or the mode itself)."""
    check_mode(draft)
    return draft if isinstance(draft, Mode) else MODES[draft]


def resolve(draft: str | Mode, drafter_kind: str | None, target_name: str, drafter_name: str,
            asked_by: str | None = None) -> Mode:
    """The mode decoding uses: `auto` resolved for the loaded drafter's kind; a mode needing another kind of
    drafter (or one when none is loaded) is a one-line UserError naming `asked_by` (where the mode came from;
    default "--draft NAME")."""
    kind = drafter_kind or "none"
    if draft == AUTO:
        return next(m for m in MODES.values() if kind in m.auto_for)
    mode = get(draft)
    if mode.drafter is None or mode.drafter == drafter_kind:
        return mode
    need = DRAFTER_NAMES[mode.drafter]
    asked = asked_by or f"--draft {mode.name}"
    if drafter_kind is None:
        raise UserError(f"{asked} needs a {need} drafter, but none is loaded for {target_name}: pass "
                        f"--drafter DIR with one, or use --draft lookup (or auto)")
    raise UserError(f"{asked} needs a {need} drafter, but {drafter_name} is a "
                    f"{DRAFTER_NAMES[drafter_kind]} drafter: pass --drafter DIR with one, or use --draft auto")
