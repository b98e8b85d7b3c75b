"""Python API: load a target (+ drafter) once, then `generate` / `stream_generate` text."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from .decode import Stats, generate_tokens
from .drafter import Drafter, check_compatible, load_drafter, random_drafter
from .errors import UserError
from .loader import DEFAULT_MODEL, Target, load_target
from .tokenizer import StreamingDetokenizer
from .tuning import DEFAULT_BEAM_LENGTH, DEFAULT_BEAM_WIDTH

DEFAULT_DRAFTERS_DIR = Path(__file__).parent / "drafters"


@dataclass
class Runner:
    """A loaded target model with an optional drafter."""

    target: Target
    drafter: Drafter | None
    drafter_name: str

    @property
    def tokenizer(self):
        return self.target.tokenizer


@dataclass
class Result:
    text: str
    tokens: list[int]
    stats: Stats
    settings: dict = field(default_factory=dict)


def shipped_drafter_path(model_name: str) -> Path | None:
    """The drafter shipped in the package for a model name, if any."""
    p = DEFAULT_DRAFTERS_DIR / model_name
    return p if (p / "config.json").exists() else None


def resolve_drafter(spec: str | None, target: Target) -> tuple[Drafter | None, str]:
    """Drafter for `spec`: 'default' (shipped for this model, if any), 'none', 'random:SEED[:EXIT_DIM]', or a path."""
    args = target.model.args
    act = target.model.dtype
    if spec in (None, "", "none"):
        return None, "none"
    if spec == "default":
        path = shipped_drafter_path(target.name)
        if path is None:
            return None, "none"
        spec = str(path)
        name = f"shipped:{target.name}"
    elif spec.startswith("random"):
        parts = spec.split(":")
        try:
            seed = int(parts[1]) if len(parts) > 1 else 0
            exit_dim = int(parts[2]) if len(parts) > 2 else None
        except ValueError:
            raise UserError(f"bad drafter spec {spec!r}: use random:SEED or random:SEED:EXIT_DIM (integers)") from None
        return random_drafter(args.hidden_size, args.vocab_size, seed, exit_dim=exit_dim, dtype=act), spec
    else:
        name = spec
    drafter = load_drafter(spec, dtype=act)
    check_compatible(drafter.args, args.hidden_size, args.vocab_size, spec)
    return drafter, name


def load(model: str | None = None, drafter: str | None = "default", dtype: str = "auto") -> Runner:
    """Load a target model (default: the embedded SmolLM2-135M) and a drafter ('default', 'none', path, random:SEED)."""
    target = load_target(model or DEFAULT_MODEL, dtype)
    d, name = resolve_drafter(drafter, target)
    return Runner(target=target, drafter=d, drafter_name=name)


def encode_prompt(runner: Runner, prompt: str | list[int], chat: bool = True) -> list[int]:
    """Token ids for a prompt: chat-formatted text, raw text, or ids given as is."""
    if isinstance(prompt, list):
        ids = prompt
    else:
        if not prompt.strip():
            raise UserError("the prompt is empty: give some text with --prompt")
        text = runner.tokenizer.chat_prompt([{"role": "user", "content": prompt}]) if chat else prompt
        ids = runner.tokenizer.encode(text)
    if not ids:
        raise UserError("the prompt is empty: give some text with --prompt")
    ctx = runner.target.model.args.max_position_embeddings
    if len(ids) >= ctx:
        raise UserError(f"the prompt has {len(ids)} tokens but the model's context is {ctx}: shorten it")
    return ids


def check_beam(beam_width: int, beam_length: int) -> None:
    if beam_width < 1:
        raise UserError(f"--beam-width must be >= 1 (got {beam_width})")
    if beam_length < 2:
        raise UserError(f"--beam-length must be >= 2: the first token plus at least one draft (got {beam_length})")


def stream_generate(
    runner: Runner,
    prompt: str | list[int],
    *,
    max_tokens: int = 256,
    beam_width: int = DEFAULT_BEAM_WIDTH,
    beam_length: int = DEFAULT_BEAM_LENGTH,
    chat: bool = True,
    no_draft: bool = False,
    stats: Stats | None = None,
) -> Iterator[tuple[str, list[int]]]:
    """Yield (text piece, new token ids) as tokens are accepted; fills `stats` if given."""
    if not no_draft:
        check_beam(beam_width, beam_length)
    ids = encode_prompt(runner, prompt, chat)
    max_tokens = min(max_tokens, runner.target.model.args.max_position_embeddings - len(ids))
    detok = StreamingDetokenizer(runner.tokenizer)
    for new in generate_tokens(
        runner.target.model, ids, drafter=None if no_draft else runner.drafter,
        beam_width=beam_width, beam_length=beam_length, max_tokens=max_tokens,
        eos_ids=runner.tokenizer.eos_ids, stats=stats,
    ):
        yield detok.add(new), new
    tail = detok.flush()
    if tail:
        yield tail, []


def generate(runner: Runner, prompt: str | list[int], **kwargs) -> Result:
    """Generate a whole completion; returns text, token ids, statistics and the settings used."""
    stats = Stats()
    pieces, tokens = [], []
    for piece, new in stream_generate(runner, prompt, stats=stats, **kwargs):
        pieces.append(piece)
        tokens.extend(new)
    drafting = runner.drafter is not None and not kwargs.get("no_draft", False)
    settings = {
        "model": runner.target.name, "dtype": runner.target.dtype,
        "drafter": runner.drafter_name if drafting else "none",
        "beam_width": kwargs.get("beam_width", DEFAULT_BEAM_WIDTH) if drafting else 0,
        "beam_length": kwargs.get("beam_length", DEFAULT_BEAM_LENGTH) if drafting else 0,
        "device": str(mx.default_device()),
    }
    return Result(text="".join(pieces), tokens=tokens, stats=stats, settings=settings)
