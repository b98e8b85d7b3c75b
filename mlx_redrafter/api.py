"""Python API: load a target (+ drafter) once, then `generate` / `stream_generate` text.

    runner = api.load()                                 # embedded SmolLM2-135M + its shipped drafter
    res = api.generate(runner, "Write a haiku.", api.DecodeOptions(max_tokens=64))
    for piece, ids in api.stream_generate(runner, "Tell me a joke."): ...
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from functools import cache, partial
from pathlib import Path

import mlx.core as mx

from mlx_redrafter.cache import KVCache
from mlx_redrafter.defaults import (
    DEFAULT_ANSWERS_WIDTH,
    DEFAULT_BEAM_LENGTH,
    DEFAULT_BEAM_WIDTH,
    DEFAULT_DRAFTER_VOCAB,
    DEFAULT_LOOKUP_MAX_LENGTH,
    DEFAULT_LOOKUP_WIDTH,
)
from mlx_redrafter.draft.kinds import NAMES as KIND_NAMES
from mlx_redrafter.draft.kinds import AnyDrafter, draft_kind, load_any_drafter
from mlx_redrafter.draft.lookup import AnswerIndex, AnswerTable, NgramIndex, SuffixIndex
from mlx_redrafter.draft.medusa import MedusaSource
from mlx_redrafter.draft.medusa_trees import DEFAULT_TREE, parse_tree
from mlx_redrafter.draft.redrafter import Drafter, check_compatible, dequantize_drafter, random_drafter
from mlx_redrafter.draft.semi_ar import SemiARSource
from mlx_redrafter.errors import UserError
from mlx_redrafter.generate import Stats, generate_ar, generate_speculative
from mlx_redrafter.models.loader import DEFAULT_MODEL, Target, load_target
from mlx_redrafter.models.tokenizer import StreamingDetokenizer
from mlx_redrafter.sampling import GREEDY, Sampling
from mlx_redrafter.sources import Allocator, LookupSource, RnnSource, Slot

SHIPPED_DRAFTERS = Path(__file__).parent / "drafters"
DRAFT_MODES = ("auto", "rnn", "lookup", "rnn+lookup", "lookup-else-rnn", "none")
HEAD_MODES = ("medusa", "semi_ar")  # drafting by a Medusa / semi-AR checkpoint (--drafter DIR of that kind)
# Lookup indices by name; the "2" variants copy only after a match of at least two tokens (fewer, better drafts).
LOOKUP_INDEXES = {"ngram": partial(NgramIndex, 4, 1), "ngram2": partial(NgramIndex, 4, 2), "suffix": SuffixIndex,
                  "suffix2": partial(SuffixIndex, 2)}


@dataclass
class Runner:
    """A loaded target model with an optional drafter."""

    target: Target
    drafter: AnyDrafter | None
    drafter_name: str

    @property
    def tokenizer(self):
        return self.target.tokenizer


@dataclass
class DecodeOptions:
    """How to decode. `draft`: auto (lookup-else-rnn with a ReDrafter, else lookup; medusa / semi_ar with a drafter of
    that kind), rnn, lookup, rnn+lookup (both every step), lookup-else-rnn (the drafter only in steps where
    lookup finds nothing to copy), medusa, semi_ar, none."""

    draft: str = "auto"
    beam_width: int = DEFAULT_BEAM_WIDTH  # W: candidates of the recurrent drafter
    beam_length: int = DEFAULT_BEAM_LENGTH  # L: candidate length, first (already decided) token included
    lookup_width: int = DEFAULT_LOOKUP_WIDTH  # candidates copied from the context
    answers_width: int = DEFAULT_ANSWERS_WIDTH  # with lookup: from the answer table where the context has none
    drafter_vocab: int | None = None  # rnn: draft from the head's N most frequent tokens (0 = all; see head_rows)
    lookup_max_length: int = DEFAULT_LOOKUP_MAX_LENGTH  # a fully accepted lookup copy grows up to this (LookupSource)
    lookup: str = "ngram"  # lookup index: ngram (prompt lookup) or suffix (suffix automaton)
    max_tokens: int = 256
    sampling: Sampling = GREEDY
    adaptive: bool = True  # back off a source that keeps failing (lookup on text it cannot copy)
    medusa_tree: str = DEFAULT_TREE  # draft medusa: the static tree (medusa_trees.TREES, or NAME:N), cut at L-1

    def check(self) -> None:
        if self.draft not in DRAFT_MODES + HEAD_MODES:
            raise UserError(f"--draft must be one of {', '.join(DRAFT_MODES + HEAD_MODES)} (got {self.draft!r})")
        if self.draft == "medusa":
            parse_tree(self.medusa_tree)
        if self.lookup not in LOOKUP_INDEXES:
            raise UserError(f"--lookup must be one of {', '.join(LOOKUP_INDEXES)} (got {self.lookup!r})")
        if self.draft != "none":
            if self.beam_width < 1:
                raise UserError(f"--beam-width must be >= 1 (got {self.beam_width})")
            if self.beam_length < 2:
                raise UserError(f"--beam-length must be >= 2: the first token plus at least one draft "
                                f"(got {self.beam_length})")
            if self.lookup_width < 1:
                raise UserError(f"--lookup-width must be >= 1 (got {self.lookup_width})")
            if self.answers_width < 0:
                raise UserError(f"--answers-width must be >= 0 (0 = off; got {self.answers_width})")
            if self.lookup_max_length < 0:
                raise UserError(f"--lookup-max-length must be >= 0 (at most --beam-length: copies do not grow; "
                                f"got {self.lookup_max_length})")
            if self.drafter_vocab is not None and self.drafter_vocab < 0:
                raise UserError(f"--drafter-vocab must be >= 0 (0 = the drafter's whole head; "
                                f"got {self.drafter_vocab})")


@dataclass
class Result:
    text: str
    tokens: list[int]
    stats: Stats
    settings: dict = field(default_factory=dict)


def shipped_folder(model_name: str) -> Path:
    """Where the package ships a model's drafter and answer table (its registry entry's drafter, else its name)."""
    from mlx_redrafter.models.registry import get

    entry = get(model_name)
    return SHIPPED_DRAFTERS / (entry.drafter if entry is not None and entry.drafter else model_name)


def shipped_drafter_path(model_name: str) -> Path | None:
    """The drafter shipped in the package for a model, or None."""
    p = shipped_folder(model_name)
    return p if (p / "config.json").exists() else None


@dataclass
class DrafterSpec:
    """A parsed --drafter value: 'default', 'none', 'random:SEED[:EXIT_DIM]' or a path."""

    kind: str  # default | none | random | path
    seed: int = 0
    exit_dim: int | None = None
    path: str = ""


def parse_drafter_spec(spec: str | None) -> DrafterSpec:
    """The one parser of drafter specs (used by loading and by tuned-settings keys)."""
    if spec in (None, "", "none"):
        return DrafterSpec("none")
    if spec == "default":
        return DrafterSpec("default")
    if spec.startswith("random"):
        parts = spec.split(":")
        try:
            return DrafterSpec("random", seed=int(parts[1]) if len(parts) > 1 else 0,
                               exit_dim=int(parts[2]) if len(parts) > 2 else None)
        except ValueError:
            raise UserError(f"bad drafter spec {spec!r}: use random:SEED or random:SEED:EXIT_DIM (integers)") from None
    return DrafterSpec("path", path=spec)


def resolve_drafter(spec: str | None, target: Target) -> tuple[AnyDrafter | None, str]:
    """(drafter, name) for a spec; 'default' is the shipped drafter of this model, or none."""
    d = parse_drafter_spec(spec)
    args, act = target.model.args, target.model.dtype
    if d.kind == "none":
        return None, "none"
    if d.kind == "random":
        return random_drafter(args.hidden_size, args.vocab_size, d.seed, exit_dim=d.exit_dim, dtype=act), spec
    if d.kind == "default":
        path = shipped_drafter_path(target.name)
        if path is None:
            return None, "none"
        drafter, name = load_any_drafter(path, dtype=act), f"shipped:{target.name}"
    else:
        drafter, name = load_any_drafter(d.path, dtype=act), d.path
    check_compatible(drafter.args, args.hidden_size, args.vocab_size, name)
    quantized = isinstance(drafter, Drafter) and drafter.args.quantization
    if quantized and act == mx.float32 and mx.default_device() == mx.cpu:
        _say_once(f"drafter {name} is {drafter.args.quantization['bits']}-bit quantized: dequantized to float32 "
                  f"(a float32 target on a CPU backend, where quantized matmuls are slow)")
        drafter = dequantize_drafter(drafter)
    return drafter, name


def answer_table(target: Target) -> AnswerTable | None:
    """The answer table shipped for this model (answers.npz beside its drafter), or None."""
    path = shipped_folder(target.name) / "answers.npz"
    return _load_answer_table(path) if path.exists() else None


@cache
def _load_answer_table(path: Path) -> AnswerTable:
    return AnswerTable.load(path)


_said: set[str] = set()


def _say_once(message: str) -> None:
    """A notice on stderr (logging's last-resort handler unless logging is configured), once per message."""
    if message not in _said:
        _said.add(message)
        logging.getLogger("mlx_redrafter").warning(message)


def load(model: str | None = None, drafter: str | None = "default", dtype: str = "auto") -> Runner:
    """Load a target model (default: the embedded SmolLM2-135M) and a drafter ('default', 'none', path, random:SEED)."""
    target = load_target(model or DEFAULT_MODEL, dtype)
    d, name = resolve_drafter(drafter, target)
    return Runner(target=target, drafter=d, drafter_name=name)


def encode_prompt(runner: Runner, prompt: str | list[int], chat: bool = True) -> list[int]:
    """Token ids for a prompt: chat-formatted text, raw text, or ids given as is."""
    if isinstance(prompt, list):
        ids = runner.tokenizer.check_ids(prompt, "the prompt's token ids")  # MLX's embedding does no bounds check
    else:
        if not prompt.strip():
            raise UserError("the prompt is empty: give some text with --prompt")
        tok = runner.tokenizer
        ids = tok.encode_chat([{"role": "user", "content": prompt}]) if chat else tok.encode(prompt)
    if not ids:
        raise UserError("the prompt is empty: give some text with --prompt")
    ctx = runner.target.model.args.max_position_embeddings
    if len(ids) >= ctx:
        raise UserError(f"the prompt has {len(ids)} tokens but the model's context is {ctx}: shorten it")
    return ids


def draft_mode(runner: Runner, options: DecodeOptions) -> str:
    """The drafting actually used: 'auto' resolved; 'rnn' without a drafter is an error, and so is a mode whose
    drafter kind (rnn, medusa, semi_ar) is not the loaded drafter's."""
    mode, kind = options.draft, draft_kind(runner.drafter)
    if mode == "auto":
        return kind if kind in HEAD_MODES else "lookup-else-rnn" if runner.drafter is not None else "lookup"
    if "rnn" in mode and runner.drafter is None:
        raise UserError(f"--draft {mode} needs a drafter, but {runner.target.name} has none: use --draft lookup "
                        f"or pass --drafter DIR")
    needs = "rnn" if "rnn" in mode else mode if mode in HEAD_MODES else None
    if needs is not None and kind != needs:
        have = f"{runner.drafter_name} is a {KIND_NAMES[kind]} drafter" if kind else f"{runner.target.name} has none"
        raise UserError(f"--draft {mode} needs a {KIND_NAMES[needs]} drafter, but {have}: pass --drafter DIR with "
                        f"one" + (f", or use --draft {kind}" if kind else ""))
    return mode


def head_rows(runner: Runner, options: DecodeOptions) -> int:
    """Rows of the ReDrafter's head to draft from (0 = all), for modes with rnn: --drafter-vocab if given, else
    DEFAULT_DRAFTER_VOCAB where the drafter's head is frequency-ordered and larger than that."""
    if options.drafter_vocab is not None:
        return options.drafter_vocab
    size = runner.drafter.args.draft_vocab_size or 0
    return DEFAULT_DRAFTER_VOCAB if size > DEFAULT_DRAFTER_VOCAB else 0


def make_allocator(runner: Runner, options: DecodeOptions) -> Allocator | None:
    """The draft sources for these options (None: plain autoregressive decoding)."""
    mode = draft_mode(runner, options)
    if mode == "none":
        return None
    drafted, copied = [], []  # plan order = candidate order: lookup first where it is the primary source
    if "rnn" in mode:
        drafted.append(Slot(RnnSource(runner.drafter, runner.target.model.embed, head_rows(runner, options)),
                            options.beam_width, backs_up="lookup" if mode == "lookup-else-rnn" else None))
    if mode == "medusa":
        medusa = MedusaSource(runner.drafter, options.medusa_tree)
        drafted.append(Slot(medusa, medusa.num_paths(options.beam_length)))
    if mode == "semi_ar":
        drafted.append(Slot(SemiARSource(runner.drafter, runner.target.model.embed), options.beam_width))
    if "lookup" in mode:
        copied.append(Slot(LookupSource(LOOKUP_INDEXES[options.lookup], max_length=options.lookup_max_length),
                           options.lookup_width))
        table = answer_table(runner.target) if options.answers_width > 0 else None
        if table is not None:
            copied.append(Slot(LookupSource(partial(AnswerIndex, table), "answers"), options.answers_width,
                               backs_up="lookup"))
    slots = copied + drafted if mode == "lookup-else-rnn" else drafted + copied
    return Allocator(slots, adaptive=options.adaptive)


def decode(runner: Runner, ids: list[int], options: DecodeOptions, *, stats: Stats | None = None,
           cache: KVCache | None = None, history: list[int] = (), profile: bool = False) -> Iterator[list[int]]:
    """Decode prompt ids with these options: yields lists of new token ids as they are accepted (AR or
    speculative); `profile=True` times every phase of a speculative step honestly (`Stats.phase_s`)."""
    model, eos = runner.target.model, runner.tokenizer.eos_ids
    room = model.args.max_position_embeddings - len(history) - len(ids)
    max_tokens = min(options.max_tokens, room)
    alloc = make_allocator(runner, options)
    if alloc is None:
        return generate_ar(model, ids, max_tokens=max_tokens, eos_ids=eos, sampling=options.sampling, stats=stats,
                           cache=cache)
    return generate_speculative(model, ids, alloc, length=options.beam_length, max_tokens=max_tokens, eos_ids=eos,
                                sampling=options.sampling, stats=stats, cache=cache, history=list(history),
                                profile=profile)


def stream_generate(runner: Runner, prompt: str | list[int], options: DecodeOptions | None = None, *,
                    chat: bool = True, stats: Stats | None = None, cache: KVCache | None = None,
                    history: list[int] = (), **overrides) -> Iterator[tuple[str, list[int]]]:
    """Yield (text piece, new token ids) as tokens are accepted; fills `stats` if given.

    To continue a conversation, pass the `cache` holding the `history` ids and only the new prompt ids.
    Keyword overrides set fields of `options` (e.g. max_tokens=64, draft="lookup")."""
    options = replace(options or DecodeOptions(), **overrides)
    options.check()
    ids = encode_prompt(runner, prompt, chat)
    detok = StreamingDetokenizer(runner.tokenizer)
    for new in decode(runner, ids, options, stats=stats, cache=cache, history=history):
        yield detok.add(new), new
    tail = detok.flush()
    if tail:
        yield tail, []


def settings(runner: Runner, options: DecodeOptions) -> dict:
    """The settings a generation ran with (for --json output and benchmark records)."""
    mode = draft_mode(runner, options)
    return {
        "model": runner.target.name, "dtype": runner.target.dtype, "draft": mode,
        "drafter": runner.drafter_name if "rnn" in mode or mode in HEAD_MODES else "none",
        "beam_width": options.beam_width if "rnn" in mode or mode == "semi_ar" else 0,
        **({"medusa_tree": options.medusa_tree} if mode == "medusa" else {}),
        "beam_length": options.beam_length if mode != "none" else 0,
        "lookup_width": options.lookup_width if "lookup" in mode else 0,
        "lookup": options.lookup if "lookup" in mode else "none",
        "lookup_max_length": max(options.lookup_max_length, options.beam_length) if "lookup" in mode else 0,
        "answers_width": options.answers_width if "lookup" in mode and answer_table(runner.target) else 0,
        "drafter_vocab": head_rows(runner, options) if "rnn" in mode else 0,
        **options.sampling.as_dict(), "device": str(mx.default_device()),
    }


def generate(runner: Runner, prompt: str | list[int], options: DecodeOptions | None = None, *, chat: bool = True,
             **overrides) -> Result:
    """Generate a whole completion; returns text, token ids, statistics and the settings used."""
    options = replace(options or DecodeOptions(), **overrides)
    stats = Stats()
    pieces, tokens = [], []
    for piece, new in stream_generate(runner, prompt, options, chat=chat, stats=stats):
        pieces.append(piece)
        tokens.extend(new)
    return Result(text="".join(pieces), tokens=tokens, stats=stats, settings=settings(runner, options))


def options_dict(options: DecodeOptions) -> dict:
    return {**asdict(options), "sampling": options.sampling.as_dict()}
