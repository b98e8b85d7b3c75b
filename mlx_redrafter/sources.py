"""Kinds of draft sources: the drafter each needs, how it is built for a loaded model and options, and what it
reports; and a mode's allocator, built from its row of `draft.modes.MODES`.

    rnn       ReDrafter beams (draft/redrafter.py)          lookup    copies from the context (draft/lookup.py)
    medusa    a Medusa static tree (draft/medusa.py)        answers   copies from the answer table (draft/lookup.py)
    semi_ar   semi-AR drafter beams (draft/semi_ar.py)      and, in every mode, where the options give them:
    grammar   what a JSON schema forces (draft/grammar.py)  prediction  copies from a predicted output (lookup.py)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from mlx_redrafter.defaults import DEFAULT_DRAFTER_VOCAB, PREDICTION_MAX_LENGTH
from mlx_redrafter.draft.base import Allocator, Slot
from mlx_redrafter.draft.grammar import GrammarSource
from mlx_redrafter.draft.kinds import AnyDrafter
from mlx_redrafter.draft.lookup import INDEXES, AnswerIndex, LookupSource, PredictionIndex
from mlx_redrafter.draft.medusa import MedusaSource
from mlx_redrafter.draft.modes import Mode
from mlx_redrafter.draft.redrafter import RnnSource
from mlx_redrafter.draft.semi_ar import SemiARSource
from mlx_redrafter.draft.weight_copies import copies_in_use
from mlx_redrafter.models.loader import Target
from mlx_redrafter.options import DecodeOptions
from mlx_redrafter.shipped import answer_table, answer_table_path


@dataclass(frozen=True)
class SourceKind:
    """A kind of draft source: `build` returns its slot (None: it has nothing to offer here, e.g. no answer
    table), `settings` what a record of the run should say about it."""

    name: str
    build: Callable[[Target, AnyDrafter | None, DecodeOptions], Slot | None]
    settings: Callable[[Target, AnyDrafter | None, DecodeOptions], dict[str, Any]]


def vocab_rows(drafter: AnyDrafter, options: DecodeOptions) -> int:
    """Rows of the ReDrafter's head to draft from (0 = all): --drafter-vocab if given, else DEFAULT_DRAFTER_VOCAB
    where the head is frequency-ordered and larger than that."""
    if options.drafter.vocab is not None:
        return options.drafter.vocab
    size = drafter.args.draft_vocab_size or 0
    return DEFAULT_DRAFTER_VOCAB if size > DEFAULT_DRAFTER_VOCAB else 0


def _rnn(target: Target, drafter: AnyDrafter | None, options: DecodeOptions) -> Slot:
    return Slot(RnnSource(drafter, target.model.embed, vocab_rows(drafter, options), options.drafter.confidence),
                options.shape.width)


def _semi_ar(target: Target, drafter: AnyDrafter | None, options: DecodeOptions) -> Slot:
    return Slot(SemiARSource(drafter, target.model.embed), options.shape.width)


def _medusa(target: Target, drafter: AnyDrafter | None, options: DecodeOptions) -> Slot:
    medusa = MedusaSource(drafter, options.drafter.medusa_tree)
    return Slot(medusa, medusa.num_paths(options.shape.length))


def _lookup(target: Target, drafter: AnyDrafter | None, options: DecodeOptions) -> Slot:
    o = options.lookup
    return Slot(LookupSource(INDEXES[o.index], max_length=o.max_length), o.width)


def _answers(target: Target, drafter: AnyDrafter | None, options: DecodeOptions) -> Slot | None:
    table = answer_table(target) if options.lookup.answers_width > 0 else None
    if table is None:
        return None
    return Slot(LookupSource(partial(AnswerIndex, table), "answers"), options.lookup.answers_width)


SOURCE_KINDS: dict[str, SourceKind] = {k.name: k for k in (
    SourceKind("rnn", _rnn, lambda t, d, o: {"beam_width": o.shape.width, "drafter_vocab": vocab_rows(d, o),
                                             "draft_confidence": o.drafter.confidence if o.shape.width == 1 else 0,
                                             "draft_weights": copies_in_use(d) if d is not None else "none"}),
    SourceKind("semi_ar", _semi_ar, lambda t, d, o: {"beam_width": o.shape.width}),
    SourceKind("medusa", _medusa, lambda t, d, o: {"medusa_tree": o.drafter.medusa_tree}),
    SourceKind("lookup", _lookup, lambda t, d, o: {
        "lookup_width": o.lookup.width, "lookup": o.lookup.index,
        "lookup_max_length": o.copy_length}),
    SourceKind("answers", _answers, lambda t, d, o: {
        "answers_width": o.lookup.answers_width if answer_table_path(t).exists() else 0}),  # not loaded to say so
)}
# What a record says about sources a mode does not use.
UNUSED = {"beam_width": 0, "drafter_vocab": 0, "draft_confidence": 0, "lookup_width": 0, "lookup": "none",
          "lookup_max_length": 0, "answers_width": 0, "draft_weights": "none"}


def for_mode(mode: Mode, options: DecodeOptions) -> DecodeOptions:
    """The options with what the mode chooses where they leave it open (the context index of lookup)."""
    return options if options.lookup.index is not None else options.updated(lookup=mode.lookup_index)


def make_allocator(mode: Mode, target: Target, drafter: AnyDrafter | None, options: DecodeOptions,
                   kinds: dict[str, SourceKind] = SOURCE_KINDS) -> Allocator | None:
    """The draft sources of a mode (None: plain autoregressive decoding)."""
    if not mode.drafts:
        return None
    options = for_mode(mode, options)
    slots = []
    for kind, backs_up in mode.sources:
        slot = kinds[kind].build(target, drafter, options)
        if slot is not None:
            slot.backs_up = backs_up
            slots.append(slot)
    if options.prediction:  # copies from the predicted output, beside the mode's own drafts
        ids = target.tokenizer.encode(options.prediction)
        grows = max(options.copy_length, PREDICTION_MAX_LENGTH)
        source = LookupSource(partial(PredictionIndex, ids), "prediction", grows, LookupSource.KIND_MATCH)
        slots.insert(0, Slot(source, 1))  # while the answer follows the prediction, its copy is the step's draft
    if options.json_schema is not None:  # what the grammar forces, beside the mode's own drafts
        slots.insert(0, Slot(GrammarSource(), 1))
    return Allocator(slots, adaptive=options.adaptive)


def source_settings(mode: Mode, target: Target, drafter: AnyDrafter | None, options: DecodeOptions,
                    kinds: dict[str, SourceKind] = SOURCE_KINDS) -> dict[str, Any]:
    """What each source of the mode ran with (zeros for sources the mode does not use)."""
    options = for_mode(mode, options)
    out = dict(UNUSED)
    for kind, _ in mode.sources:
        out.update(kinds[kind].settings(target, drafter, options))
    return out
