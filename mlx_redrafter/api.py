"""Python API: load a target (+ drafter) once, then `generate` / `stream_generate` text.

    lm = api.load()                                      # embedded SmolLM2-135M + its shipped drafter
    res = api.generate(lm, "Write a haiku.", max_tokens=64)
    for r in api.stream_generate(lm, "Tell me a joke.", draft="lookup"): print(r.text, end="")

Options are `options.DecodeOptions` (built with `decode_options(**flat)`) or keyword overrides by the same flat
names; draft modes are the rows of `draft.modes.MODES`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

import mlx.core as mx

from mlx_redrafter.batch.budget import CostCurve
from mlx_redrafter.cache import KVCache
from mlx_redrafter.constraint import Constraint
from mlx_redrafter.draft import modes
from mlx_redrafter.draft.base import Allocator
from mlx_redrafter.draft.kinds import AnyDrafter, check_drafter_files, draft_kind, load_any_drafter
from mlx_redrafter.draft.modes import Mode
from mlx_redrafter.draft.redrafter import (
    Drafter,
    check_compatible,
    dequantize_drafter,
    random_drafter,
    read_features,
)
from mlx_redrafter.draft.weight_copies import use_weight_copies
from mlx_redrafter.drafter_spec import DrafterSpec, parse_drafter_spec  # noqa: F401 (re-exported)
from mlx_redrafter.errors import UserError
from mlx_redrafter.generate import Record, Stats, generate_ar, generate_speculative
from mlx_redrafter.logprobs import TokenLogprob
from mlx_redrafter.models.loader import DEFAULT_MODEL, Target, load_target
from mlx_redrafter.models.tokenizer import StreamingDetokenizer
from mlx_redrafter.options import DecodeOptions, decode_options
from mlx_redrafter.sampling import check_bias_ids
from mlx_redrafter.shipped import answer_table, shipped_drafter_path, shipped_folder
from mlx_redrafter.sources import make_allocator as allocator_of_mode
from mlx_redrafter.sources import source_settings

__all__ = ["LoadedModel", "DecodeOptions", "decode_options", "Response", "Result", "load", "generate",
           "stream_generate", "generate_batch", "stream_batch", "decode", "settings", "encode_prompt", "answer_table",
           "TokenLogprob",
           "shipped_drafter_path", "shipped_folder"]


@dataclass
class LoadedModel:
    """A loaded target model with an optional drafter; pairing them sets the target's forward to provide what the
    drafter reads (`read_features`: the layers a drafter that fuses several reads, else the last alone)."""

    target: Target
    drafter: AnyDrafter | None
    drafter_name: str

    def __post_init__(self) -> None:
        read_features(self.target.model, self.drafter)

    @property
    def tokenizer(self):
        return self.target.tokenizer

    @property
    def drafter_kind(self) -> str | None:
        """rnn, medusa or semi_ar (None without a drafter)."""
        return draft_kind(self.drafter)


@dataclass
class Response:
    """What `stream_generate` yields per target call: the new text, its token ids, and the call's record."""

    text: str
    tokens: list[int]
    record: Record | None  # None for the detokenizer's final flush


@dataclass
class Result:
    """A whole completion: its text, token ids, statistics, settings, and (when asked for with `logprobs`) each
    token's log-probability."""

    text: str
    tokens: list[int]
    stats: Stats
    settings: dict = field(default_factory=dict)
    logprobs: list[TokenLogprob] | None = None


def resolve_drafter(spec: str | None, target: Target) -> tuple[AnyDrafter | None, str]:
    """(drafter, name) for a spec; 'default' is the shipped drafter of this model, or none. The target's forward
    is set to provide what the drafter reads (`read_features`)."""
    drafter, name = _load_drafter(spec, target)
    read_features(target.model, drafter)
    return drafter, name


def _load_drafter(spec: str | None, target: Target) -> tuple[AnyDrafter | None, str]:
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
    check_compatible(drafter.args, args.hidden_size, args.vocab_size, name, args.num_hidden_layers)
    quantized = isinstance(drafter, Drafter) and drafter.args.quantization
    if quantized and act == mx.float32 and mx.default_device() == mx.cpu:
        _say_once(f"drafter {name} is {drafter.args.quantization['bits']}-bit quantized: dequantized to float32 "
                  f"(a float32 target on a CPU backend, where quantized matmuls are slow)")
        drafter = dequantize_drafter(drafter)
    if isinstance(drafter, Drafter) and act == mx.float32:
        use_weight_copies(drafter)  # on a CPU with our kernel: drafting reads 8-bit (or float16) copies
    return drafter, name


_said: set[str] = set()


def _say_once(message: str) -> None:
    """A notice on stderr (logging's last-resort handler unless logging is configured), once per message."""
    if message not in _said:
        _said.add(message)
        logging.getLogger("mlx_redrafter").warning(message)


def load(model: str | None = None, drafter: str | None = "default", dtype: str = "auto") -> LoadedModel:
    """Load a target model (default: the embedded SmolLM2-135M) and a drafter ('default', 'none', path, random:SEED).
    A drafter path whose own files are malformed fails before the target loads."""
    spec = parse_drafter_spec(drafter)
    if spec.kind == "path":
        check_drafter_files(spec.path)
    target = load_target(model or DEFAULT_MODEL, dtype)
    d, name = resolve_drafter(drafter, target)
    return LoadedModel(target=target, drafter=d, drafter_name=name)


def encode_prompt(lm: LoadedModel, prompt: str | list[int], chat: bool = True) -> list[int]:
    """Token ids for a prompt: chat-formatted text, raw text, or ids given as is."""
    if isinstance(prompt, list):
        ids = lm.tokenizer.check_ids(prompt, "the prompt's token ids")  # MLX's embedding does no bounds check
    else:
        if not prompt.strip():
            raise UserError("the prompt is empty: give some text with --prompt")
        tok = lm.tokenizer
        ids = tok.encode_chat([{"role": "user", "content": prompt}]) if chat else tok.encode(prompt)
    if not ids:
        raise UserError("the prompt is empty: give some text with --prompt")
    ctx = lm.target.model.args.max_position_embeddings
    if len(ids) >= ctx:
        raise UserError(f"the prompt has {len(ids)} tokens but the model's context is {ctx}: shorten it")
    return ids


def draft_mode(lm: LoadedModel, options: DecodeOptions) -> Mode:
    """The mode decoding uses (`draft.modes.resolve`: 'auto' resolved, a missing drafter an error)."""
    return modes.resolve(options.draft, lm.drafter_kind, lm.target.name, lm.drafter_name)


def check_for_model(lm: LoadedModel, options: DecodeOptions) -> None:
    """One-line UserError, before any output, for options this model cannot decode with: a draft mode its drafter
    cannot serve, logit-bias ids outside its vocabulary."""
    draft_mode(lm, options)
    check_bias_ids(options.sampling, lm.target.model.args.vocab_size)


def make_allocator(lm: LoadedModel, options: DecodeOptions) -> Allocator | None:
    """The draft sources for these options (None: plain autoregressive decoding)."""
    return allocator_of_mode(draft_mode(lm, options), lm.target, lm.drafter, options)


def make_constraint(lm: LoadedModel, options: DecodeOptions) -> Constraint | None:
    """A new sequence's grammar for these options (`json_schema`; None without one)."""
    if options.json_schema is None:
        return None
    return Constraint(options.json_schema, lm.tokenizer, lm.target.model.args.vocab_size)


def decode(lm: LoadedModel, ids: list[int], options: DecodeOptions, *, cache: KVCache | None = None,
           history: list[int] = (), profile: bool = False) -> Iterator[Record]:
    """Decode prompt ids: one record per target call (generate.py); `profile=True` times every phase of a
    speculative step honestly. With a `cache` holding the `history` ids, the cache afterwards holds history +
    ids + every emitted token, however the generation ends."""
    model, eos = lm.target.model, lm.tokenizer.eos_ids
    room = model.args.max_position_embeddings - len(history) - len(ids)
    max_tokens = min(options.max_tokens, room)
    check_for_model(lm, options)
    alloc = make_allocator(lm, options)
    constraint = make_constraint(lm, options)
    if alloc is None:
        return generate_ar(model, ids, max_tokens=max_tokens, eos_ids=eos, sampling=options.sampling, cache=cache,
                           history=list(history), logprobs=options.logprobs, constraint=constraint)
    return generate_speculative(model, ids, alloc, length=options.shape.length, max_tokens=max_tokens, eos_ids=eos,
                                sampling=options.sampling, cache=cache, history=list(history), profile=profile,
                                logprobs=options.logprobs, constraint=constraint)


def stream_generate(lm: LoadedModel, prompt: str | list[int], options: DecodeOptions | None = None, *,
                    chat: bool = True, cache: KVCache | None = None, history: list[int] = (),
                    **overrides) -> Iterator[Response]:
    """Yield a `Response` per target call as tokens are accepted (text pieces, ids, the call's record).

    To continue a conversation, pass the `cache` holding the `history` ids and only the new prompt ids.
    Keyword overrides set options by flat name (e.g. max_tokens=64, draft="lookup", beam_width=2)."""
    options = (options or DecodeOptions()).updated(**overrides)
    options.check()
    ids = encode_prompt(lm, prompt, chat)
    detok = StreamingDetokenizer(lm.tokenizer)
    records = decode(lm, ids, options, cache=cache, history=history)
    try:
        for r in records:
            yield Response(detok.add(r.tokens), r.tokens, r)
    finally:
        records.close()  # settles the cache now, not when the generator is collected
    tail = detok.flush()
    if tail:
        yield Response(tail, [], None)


def settings(lm: LoadedModel, options: DecodeOptions) -> dict:
    """The settings a generation ran with (for --json output and benchmark records)."""
    from mlx_redrafter.system.blas import blas_name, status

    mode = draft_mode(lm, options)
    return {
        "model": lm.target.name, "dtype": lm.target.dtype, "draft": mode.name,
        "drafter": lm.drafter_name if mode.drafter else "none",
        "beam_length": options.shape.length if mode.drafts else 0,
        **source_settings(mode, lm.target, lm.drafter, options),
        **options.sampling.as_dict(), "device": str(mx.default_device()), "blas": blas_name(),
        "blas_status": status().as_dict(),
    }


def generate(lm: LoadedModel, prompt: str | list[int], options: DecodeOptions | None = None, *, chat: bool = True,
             **overrides) -> Result:
    """Generate a whole completion; returns text, token ids, statistics and the settings used."""
    options = (options or DecodeOptions()).updated(**overrides)
    stats = Stats()
    pieces, tokens, logprobs = [], [], []
    for r in stream_generate(lm, prompt, options, chat=chat):
        pieces.append(r.text)
        tokens.extend(r.tokens)
        if r.record is not None:
            stats.add(r.record)
            logprobs.extend(r.record.logprobs or ())
    return Result(text="".join(pieces), tokens=tokens, stats=stats, settings=settings(lm, options),
                  logprobs=None if options.logprobs is None else logprobs)


def stream_batch(lm: LoadedModel, prompts: list[str | list[int]], options: DecodeOptions | None = None, *,
                 batch_size: int = 4, chat: bool = True, curve: CostCurve | None = None,
                 **overrides) -> Iterator[tuple[int, Response]]:
    """Decode many prompts, `batch_size` rows sharing each target call (continuous batching, batch/loop.py):
    yields `(index, Response)` per row and call, `index` being the prompt's place in `prompts`. Each row's text
    is what `stream_generate` gives for that prompt alone. `curve` (a measured `batch.budget.CostCurve`) lets
    each step choose how many tokens the rows verify (measure it up to `options.copy_length` tokens per row: a
    context copy may grow that long); without it every drafting row drafts the full length."""
    from mlx_redrafter.batch.budget import Budget
    from mlx_redrafter.batch.loop import generate_batch as batch_loop

    options = (options or DecodeOptions()).updated(**overrides)
    options.check()
    ids = [encode_prompt(lm, p, chat) for p in prompts]
    model = lm.target.model
    room = model.args.max_position_embeddings - max(len(x) for x in ids)
    check_for_model(lm, options)
    detoks = [StreamingDetokenizer(lm.tokenizer) for _ in ids]
    records = batch_loop(model, ids, batch_size=batch_size, max_tokens=min(options.max_tokens, room),
                         eos_ids=lm.tokenizer.eos_ids, sampling=options.sampling,
                         allocator=lambda: make_allocator(lm, options), length=options.shape.length,
                         budget=Budget(options.shape.length, curve),
                         logprobs=options.logprobs, constraint=lambda: make_constraint(lm, options))
    for index, r in records:
        yield index, Response(detoks[index].add(r.tokens), r.tokens, r)
        if r.stop:
            tail = detoks[index].flush()
            if tail:
                yield index, Response(tail, [], None)


def generate_batch(lm: LoadedModel, prompts: list[str | list[int]], options: DecodeOptions | None = None, *,
                   batch_size: int = 4, chat: bool = True, curve: CostCurve | None = None,
                   **overrides) -> list[Result]:
    """Whole completions of many prompts decoded `batch_size` at a time (see `stream_batch`), in prompt order.
    Each result's stats count its own tokens; their `decode_s` is the wall time of the calls it shared."""
    options = (options or DecodeOptions()).updated(**overrides)
    pieces: list[list[str]] = [[] for _ in prompts]
    tokens: list[list[int]] = [[] for _ in prompts]
    logprobs: list[list[TokenLogprob]] = [[] for _ in prompts]
    stats = [Stats() for _ in prompts]
    for i, r in stream_batch(lm, prompts, options, batch_size=batch_size, chat=chat, curve=curve):
        pieces[i].append(r.text)
        tokens[i].extend(r.tokens)
        if r.record is not None:
            stats[i].add(r.record)
            logprobs[i].extend(r.record.logprobs or ())
    base = settings(lm, options)
    return [Result(text="".join(p), tokens=t, stats=s, settings={**base, "batch_size": batch_size},
                   logprobs=None if options.logprobs is None else lp)
            for p, t, s, lp in zip(pieces, tokens, stats, logprobs)]


def cost_curve(lm: LoadedModel, batch_size: int, length: int) -> CostCurve:
    """The measured cost of batched target calls for this model on this machine (batch/budget.py), measured
    and kept the first time a batch of this size needs it (a few seconds; a notice says so)."""
    from mlx_redrafter.batch.budget import measured_curve
    from mlx_redrafter.system.machine import fingerprint

    return measured_curve(lm.target.model, lm.target.name, fingerprint(), batch_size, length, log=_say_once)
