"""The drafter interface: sources of candidate continuations, and how a step's verify budget is shared.

A source proposes candidates for the next step: an int32 array (n, L) whose column 0 is the token the target
already decided (g0) and whose other columns are guesses; a candidate that ends early is padded with
`tree.PAD`; L is the step's length (context lookup may propose longer copies: `LookupSource`). The decode step
merges the candidates of every source, packs them into one tree, verifies them in one target call and keeps the
longest accepted run, whichever source proposed it.

Sources here: `RnnSource` (ReDrafter's recurrent head + beam search) and `LookupSource` (copies from the
context, see lookup.py). Medusa heads (`medusa.MedusaSource`: a static tree as PAD-padded root-to-leaf paths)
and the semi-autoregressive drafter (`semi_ar.SemiARSource`: beam search over its TLM) plug in the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx

from mlx_redrafter.draft.beam_search import beam_search, greedy_draft
from mlx_redrafter.draft.redrafter import FrequentHead


@dataclass
class DecodeState:
    """What a source may look at: the decided tokens and the target's state at the last one."""

    tokens: list[int]  # every decided token (history + prompt + generated); the last one is g0
    g0: mx.array  # (1,) int32: the last decided token, not yet in the KV cache
    h: mx.array  # (1, H): the target's post-norm hidden state at the position before g0


class DraftSource(Protocol):
    """A source of candidate continuations (see the module docstring)."""

    name: str

    def start(self, tokens: list[int]) -> None:
        """A new sequence begins; `tokens` are all decided tokens (g0 last)."""

    def extend(self, tokens: list[int]) -> None:
        """Tokens decided by the last step were appended."""

    def propose(self, state: DecodeState, length: int, width: int) -> mx.array | None:
        """Up to `width` candidates of length `length` (column 0 = g0), or None when there is nothing."""


class RnnSource:
    """ReDrafter: W beams of the recurrent draft head, conditioned on the target's hidden state."""

    name = "rnn"

    def __init__(self, drafter, embed: Callable[[mx.array], mx.array], head_rows: int = 0):
        """`head_rows` > 0: draft with only that many of the head's most frequent tokens (`FrequentHead`)."""
        if head_rows:
            drafter = FrequentHead(drafter, head_rows)
        self.drafter, self.embed = drafter, embed

    def start(self, tokens: list[int]) -> None:
        pass

    def extend(self, tokens: list[int]) -> None:
        pass

    def propose(self, state: DecodeState, length: int, width: int) -> mx.array | None:
        if width == 1:
            return greedy_draft(self.drafter, self.embed, state.h, state.g0, length)[0]
        beams, _ = beam_search(self.drafter, self.embed, state.h, state.g0, width, length)
        return beams[0]


class LookupSource:
    """Training-free drafts copied from the context (an index of lookup.py kept in step with the tokens).

    With `max_length` above the step's length, a copy that keeps being accepted grows: after a step that accepted
    every token this source proposed, its next candidates may copy twice as many, up to `max_length` tokens
    (g0 included); any other step sets them back to the step's length (long copies only where the text is
    being copied).
    """

    optional = True  # may sit out (Allocator) when it keeps finding nothing worth verifying

    def __init__(self, index_factory: Callable[[], object], name: str = "lookup", max_length: int = 0):
        self.factory, self.name, self.max_length = index_factory, name, max_length
        self.index = index_factory()
        self.proposed: list[list[int]] = []  # the drafts of this step's candidates
        self.asked = 0  # drafts this step's candidates could have had
        self.grown = 0  # drafts the next step may ask for (0: the step's length)

    def start(self, tokens: list[int]) -> None:
        self.index = self.factory()
        self.index.extend(tokens)
        self.proposed, self.grown = [], 0

    def extend(self, tokens: list[int]) -> None:
        self.index.extend(tokens)
        copied = any(len(c) == self.asked and tokens[: len(c)] == c for c in self.proposed)
        self.grown = 2 * self.asked if copied else 0
        self.proposed = []

    def longest(self, length: int) -> int:
        """The longest candidates (g0 included) this source proposes in steps of `length`."""
        return max(length, self.max_length)

    def propose(self, state: DecodeState, length: int, width: int) -> mx.array | None:
        self.asked = min(max(length - 1, self.grown), self.longest(length) - 1)
        self.proposed = self.index.candidates(self.asked, width)
        if not self.proposed:
            return None
        from mlx_redrafter.tree import PAD

        rows = [[state.tokens[-1], *c] + [PAD] * (self.asked - len(c)) for c in self.proposed]
        return mx.array(rows, dtype=mx.int32)


@dataclass
class Slot:
    """One source in a step's plan and how many candidates it may propose; a slot that `backs_up` another source
    proposes only in steps where that source proposed nothing (e.g. the answer table behind context lookup)."""

    source: DraftSource
    width: int
    backs_up: str | None = None


def longest(slot: Slot, length: int) -> int:
    """The longest candidates (g0 included) a slot proposes in steps of `length` (only lookup's may be longer)."""
    grows = getattr(slot.source, "longest", None)
    return grows(length) if grows is not None else length


def propose(plan: list[Slot], state: DecodeState, length: int) -> list[tuple[str, mx.array]]:
    """(source name, candidates (n, L)) of every slot that proposes this step, in plan order. Backup slots are
    asked after the others, wherever they stand in the plan (one level: a backup does not back up a backup)."""
    got: dict[int, mx.array] = {}
    for i in sorted(range(len(plan)), key=lambda i: plan[i].backs_up is not None):
        slot = plan[i]
        if slot.width <= 0 or any(plan[j].source.name == slot.backs_up for j in got):
            continue
        c = slot.source.propose(state, length, slot.width)
        if c is not None:
            got[i] = c
    return [(plan[i].source.name, got[i]) for i in sorted(got)]


class Allocator:
    """Shares a step's candidates between sources.

    Fixed (default): every source proposes up to its width every step. Adaptive: a source that may sit out
    (`optional`, e.g. lookup, which only sometimes finds text worth copying) is left out while the drafts its
    best candidates had accepted, an exponential moving average, stay below `min_gain` per step (its candidates
    would only add verify cost), except on every `probe`-th step, so it comes back as soon as it is useful
    again. Sources the user sized (the drafter's W) always keep their width.
    """

    def __init__(self, slots: list[Slot], adaptive: bool = False, min_gain: float = 0.15, decay: float = 0.8,
                 probe: int = 8):
        self.slots, self.adaptive = slots, adaptive
        self.min_gain, self.decay, self.probe = min_gain, decay, probe
        self.gain = {s.source.name: 1.0 for s in slots}
        self.step = 0

    def plan(self) -> list[Slot]:
        """The slots of the next step (sources sitting out get width 0)."""
        self.step += 1
        if not self.adaptive or self.step % self.probe == 0:
            return self.slots
        return [Slot(s.source, 0) if getattr(s.source, "optional", False) and self.gain[s.source.name] < self.min_gain
                else s for s in self.slots]

    def update(self, runs: dict[str, int]) -> None:
        """Record the drafts each proposing source's best candidate had accepted in the last step."""
        for name, run in runs.items():
            self.gain[name] = self.decay * self.gain[name] + (1 - self.decay) * run

    @property
    def sources(self) -> list[DraftSource]:
        return [s.source for s in self.slots]
