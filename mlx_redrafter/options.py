"""How to decode: small groups of options, the flat names the CLI, tuned settings and keyword overrides use, and
their checks.

    options = decode_options(draft="rnn", beam_width=2, max_tokens=64, temp=0.7, seed=1)
    options.shape.width, options.sampling.temperature        # 2, 0.7
    options.updated(beam_length=5)                           # a copy with one field changed

Every route into decoding (Python keyword overrides, CLI flags, tuned settings, the server) names options by the
flat names of `FLAT` and goes through `DecodeOptions.updated`, so they are merged and checked in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

from mlx_redrafter.constraint import check_schema, schema_text
from mlx_redrafter.defaults import (
    DEFAULT_ANSWERS_WIDTH,
    DEFAULT_BEAM_LENGTH,
    DEFAULT_BEAM_WIDTH,
    DEFAULT_DRAFT_CONFIDENCE,
    DEFAULT_LOOKUP_MAX_LENGTH,
    DEFAULT_LOOKUP_WIDTH,
)
from mlx_redrafter.draft.lookup import INDEXES
from mlx_redrafter.draft.medusa_trees import DEFAULT_TREE, parse_tree
from mlx_redrafter.draft.modes import Mode, check_mode
from mlx_redrafter.errors import UserError
from mlx_redrafter.logprobs import MAX_TOP_LOGPROBS
from mlx_redrafter.sampling import GREEDY, Sampling

# Upper bounds that keep a step's verification (and the cache's scratch region) a sane size.
MAX_CANDIDATES = 64  # candidates of one source per step
MAX_CANDIDATE_LENGTH = 64  # tokens of a candidate, g0 included (a growing lookup copy included)


def _check_int(value: Any, flag: str, lo: int, hi: int, note: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise UserError(f"{flag} must be an integer from {lo} to {hi}{note} (got {value!r})")


@dataclass(frozen=True, kw_only=True)
class Shape:
    """What each step drafts: `width` (W) candidates of the drafter, `length` (L) tokens each, g0 included."""

    width: int = DEFAULT_BEAM_WIDTH
    length: int = DEFAULT_BEAM_LENGTH

    def check(self) -> None:
        _check_int(self.width, "--beam-width", 1, MAX_CANDIDATES)
        _check_int(self.length, "--beam-length", 2, MAX_CANDIDATE_LENGTH, " (the first token plus the drafts)")


@dataclass(frozen=True, kw_only=True)
class LookupOptions:
    """Drafting by copying: `width` candidates from the context by the `index` (draft.lookup.INDEXES; None: the
    one the draft mode names, `draft.modes.Mode.lookup_index`), a copy that
    keeps being accepted growing up to `max_length` tokens, and `answers_width` candidates from the model's
    answer table in steps where the context has nothing to copy (0 = off)."""

    width: int = DEFAULT_LOOKUP_WIDTH
    index: str | None = None
    max_length: int = DEFAULT_LOOKUP_MAX_LENGTH
    answers_width: int = DEFAULT_ANSWERS_WIDTH

    def check(self) -> None:
        if self.index is not None and self.index not in INDEXES:
            raise UserError(f"--lookup must be one of {', '.join(INDEXES)} (got {self.index!r})")
        _check_int(self.width, "--lookup-width", 1, MAX_CANDIDATES)
        _check_int(self.max_length, "--lookup-max-length", 0, MAX_CANDIDATE_LENGTH,
                   " (at most --beam-length: copies do not grow)")
        _check_int(self.answers_width, "--answers-width", 0, MAX_CANDIDATES, " (0 = off)")


@dataclass(frozen=True, kw_only=True)
class DrafterOptions:
    """Options of trained drafters: the ReDrafter's draft vocabulary (`vocab` most frequent head rows; 0 = all;
    None = the default rule, see `sources.vocab_rows`) and Medusa's static tree (draft.medusa_trees)."""

    vocab: int | None = None
    medusa_tree: str = DEFAULT_TREE
    confidence: float = DEFAULT_DRAFT_CONFIDENCE

    def check(self) -> None:
        if self.vocab is not None:
            _check_int(self.vocab, "--drafter-vocab", 0, 1 << 24, " (0 = the drafter's whole head)")
        c = self.confidence
        if isinstance(c, bool) or not isinstance(c, int | float) or not 0 <= c < 1:
            raise UserError(f"--draft-confidence must be a number in [0, 1) (0 = drafts of the full length; "
                            f"got {c!r})")
        parse_tree(self.medusa_tree)


@dataclass(frozen=True, kw_only=True)
class DecodeOptions:
    """How to decode: the draft mode (a name of `draft.modes.MODES`, 'auto', or a `Mode`), its option groups,
    sampling, the answer's length, and whether a source that keeps failing may sit out (`Allocator`)."""

    draft: str | Mode = "auto"
    shape: Shape = field(default_factory=Shape)
    lookup: LookupOptions = field(default_factory=LookupOptions)
    drafter: DrafterOptions = field(default_factory=DrafterOptions)
    sampling: Sampling = GREEDY
    max_tokens: int = 256
    adaptive: bool = True
    logprobs: int | None = None  # report each emitted token's log-probability and this many alternatives (logprobs.py)
    json_schema: str | None = None  # a JSON schema (as JSON text) the answer must follow (constraint.py)
    prediction: str | None = None  # text the answer is expected to repeat largely, drafted from (PredictionIndex)

    @property
    def copy_length(self) -> int:
        """The longest a context copy may grow (tokens with g0): at least the candidate length."""
        return max(self.lookup.max_length, self.shape.length)

    def check(self) -> None:
        """A one-line UserError naming the first bad option."""
        check_mode(self.draft)
        _check_int(self.max_tokens, "--max-tokens", 1, 1 << 31)
        if self.logprobs is not None:
            _check_int(self.logprobs, "--logprobs", 0, MAX_TOP_LOGPROBS, " (alternatives listed per token)")
        if self.json_schema is not None:
            check_schema(self.json_schema)
        if self.prediction is not None and not isinstance(self.prediction, str):
            raise UserError(f"--prediction must be text (got {type(self.prediction).__name__})")
        self.shape.check()
        self.lookup.check()
        self.drafter.check()

    def updated(self, **flat: Any) -> DecodeOptions:
        """A copy with options changed by flat name (`FLAT`; sampling fields included); None leaves a field as is."""
        given = {k: v for k, v in flat.items() if v is not None}
        unknown = sorted(set(given) - set(FLAT) - set(SAMPLING_FLAT) - {"sampling"})
        if unknown:
            raise UserError(f"unknown decoding option(s) {', '.join(unknown)} (known: "
                            f"{', '.join([*FLAT, *SAMPLING_FLAT])})")
        top: dict[str, Any] = {}
        groups: dict[str, dict[str, Any]] = {}
        for name, value in given.items():
            if name == "sampling":
                top["sampling"] = value
            elif name == "json_schema":  # a schema object or its JSON text
                top["json_schema"] = schema_text(value)
            elif name in SAMPLING_FLAT:
                groups.setdefault("sampling", {})[SAMPLING_FLAT[name]] = value
            else:
                group, attr = FLAT[name]
                (groups.setdefault(group, {}) if group else top)[attr] = value
        for group, changes in groups.items():
            top[group] = replace(top.get(group, getattr(self, group)), **changes)
        return replace(self, **top)

    def flat(self) -> dict[str, Any]:
        """Every option by its flat name (sampling by its fields' names)."""
        out = {name: getattr(getattr(self, g), a) if g else getattr(self, a) for name, (g, a) in FLAT.items()}
        out["draft"] = getattr(self.draft, "name", self.draft)
        return {**out, **{f.name: getattr(self.sampling, f.name) for f in fields(Sampling)}}


# Flat name -> (group, field); group None: a field of DecodeOptions itself.
FLAT: dict[str, tuple[str | None, str]] = {
    "draft": (None, "draft"),
    "beam_width": ("shape", "width"),
    "beam_length": ("shape", "length"),
    "lookup_width": ("lookup", "width"),
    "lookup": ("lookup", "index"),
    "lookup_max_length": ("lookup", "max_length"),
    "answers_width": ("lookup", "answers_width"),
    "drafter_vocab": ("drafter", "vocab"),
    "medusa_tree": ("drafter", "medusa_tree"),
    "draft_confidence": ("drafter", "confidence"),
    "max_tokens": (None, "max_tokens"),
    "adaptive": (None, "adaptive"),
    "logprobs": (None, "logprobs"),
    "json_schema": (None, "json_schema"),
    "prediction": (None, "prediction"),
}
# Sampling's fields, by the CLI's names and by their own.
SAMPLING_FLAT = {"temp": "temperature", **{f.name: f.name for f in fields(Sampling)}}


def decode_options(**flat: Any) -> DecodeOptions:
    """Options from flat names over the defaults (see `FLAT`), checked."""
    options = DecodeOptions().updated(**flat)
    options.check()
    return options
