"""The draft layer's contract: what a source of candidates sees, what it returns, and how a step's plan is made.

A source proposes candidates for the next step: an int32 array (n, L') whose column 0 is the token the target
already decided (g0) and whose other columns are guesses; a candidate that ends early is padded with `PAD`. L' is at
most the step's length L (shorter where a source ends its drafts early, e.g. the drafter where it doubts), or up to
`candidate_length(L)` for a source whose candidates may grow (context lookup). `propose` collects the candidates of
every slot of a step's plan into one PAD-padded array, in plan order, with the rows each source owns; the step packs
that array into one tree and verifies it in one target call.

Candidates must be a deterministic function of the decided tokens and the target's state (`DecodeState`) and
of what the source was told through `start` / `extend`: exact sampling verifies each candidate against the
target's distribution and relies on the drafts not depending on anything the target did not see.

This module imports nothing of the package but the packed tree (tree.py): every source builds on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx

from mlx_redrafter.tree import PAD, PackedTree, chain, pack


@dataclass
class DecodeState:
    """What a source may look at: the decided tokens and the target's state at the last one."""

    tokens: list[int]  # every decided token (history + prompt + generated); the last one is g0
    g0: mx.array  # (1,) int32: the last decided token, not yet in the KV cache
    h: mx.array  # (1, H): the target's post-norm hidden state at the position before g0
    constraint: Any = None  # a grammar the answer follows (constraint.Constraint), advanced over g0


class DraftSource(Protocol):
    """A source of candidate continuations (see the module docstring). A source may also have a `batch_key` and
    `propose_many(states, length, width)` (`propose` for each state, in order): sources with equal keys are
    interchangeable (stateless, same weights), and `propose_rows` asks one of them for every row of a batch."""

    name: str
    optional: bool  # may sit out steps where it keeps finding nothing worth verifying (`Allocator`)
    pads: bool  # one candidate may end (PAD) before the full length; False: it packs without a host sync
    exclusive: bool  # its proposal of this step is trusted alone: the sources after it sit the step out

    def start(self, tokens: list[int]) -> None:
        """A new sequence begins; `tokens` are all decided tokens (g0 last)."""

    def extend(self, tokens: list[int]) -> None:
        """Tokens decided by the last step were appended."""

    def candidate_length(self, length: int) -> int:
        """The longest candidates (g0 included) this source proposes in steps of `length`."""

    def propose(self, state: DecodeState, length: int, width: int) -> mx.array | None:
        """Up to `width` candidates (column 0 = g0), or None when there is nothing to propose."""


class Source:
    """Defaults for a stateless source of fixed-length candidates (subclasses set `name`, define `propose`)."""

    name = "source"
    optional = False
    pads = True
    exclusive = False

    def start(self, tokens: list[int]) -> None:
        pass

    def extend(self, tokens: list[int]) -> None:
        pass

    def candidate_length(self, length: int) -> int:
        return length


@dataclass
class Slot:
    """One source in a step's plan and how many candidates it may propose; a slot that `backs_up` another source
    proposes only in steps where that source proposed nothing (e.g. the answer table behind context lookup)."""

    source: DraftSource
    width: int
    backs_up: str | None = None


@dataclass
class Proposal:
    """A step's candidates: one PAD-padded array (n, L') and, in row order, which source owns how many rows."""

    candidates: mx.array
    rows: list[tuple[str, int]]
    chain: int = 0  # > 0: one candidate, real up to this many slots (its packed tree is known without a sync)

    def pack(self) -> PackedTree:
        """The candidates' packed tree (`tree.pack`; `tree.chain` for one candidate of known length)."""
        return chain(self.candidates, self.chain) if self.chain else pack(self.candidates)

    def by_source(self, per_row: list[int]) -> dict[str, int]:
        """Per source, the best of a per-candidate value (e.g. the drafts each candidate had accepted)."""
        out: dict[str, int] = {}
        start = 0
        for name, n in self.rows:
            out[name] = max(out.get(name, 0), *per_row[start : start + n])
            start += n
        return out

    def owner(self, row: int) -> str:
        """The source that proposed candidate `row`."""
        start = 0
        for name, n in self.rows:
            if row < start + n:
                return name
            start += n
        return ""

    def proposed(self) -> dict[str, int]:
        """Per source, the candidates it proposed."""
        out: dict[str, int] = {}
        for name, n in self.rows:
            out[name] = out.get(name, 0) + n
        return out


def propose(plan: list[Slot], state: DecodeState, length: int) -> Proposal:
    """The candidates of every slot that proposes this step, in plan order, padded to one width. Backup slots are
    asked after the others, wherever they stand in the plan (one level: a backup does not back up a backup).
    With nothing proposed, the one candidate is g0 alone (the step is then an autoregressive step)."""
    return propose_rows([plan], [state], [length])[0]


def propose_rows(plans: list[list[Slot]], states: list[DecodeState], lengths: list[int],
                 host: list[dict[int, mx.array]] | None = None) -> list[Proposal]:
    """`propose` for several sequences at once (a batched step): each row's proposal is what `propose` gives it
    alone, but sources with the same `batch_key` (e.g. one drafter shared by every row) are asked once for all the
    rows that need them, so a batch reads the drafter's weights once per drafted token instead of once per row.
    `host`: what `host_proposals` already gave (a batched step asks those sources first, to price the step by
    what they found)."""
    got = [dict(g) for g in host] if host is not None else host_proposals(plans, states, lengths)
    _ask(plans, states, lengths, got, lambda plan, slot: not _in_host_pass(plan, slot))
    return [_proposal(plan, got_r, state, length) for plan, got_r, state, length in zip(plans, got, states, lengths)]


def host_proposals(plans: list[list[Slot]], states: list[DecodeState], lengths: list[int]
                   ) -> list[dict[int, mx.array]]:
    """Per row, slot index -> candidates of the sources that draft one row at a time on the host (no
    `batch_key`: context lookup, the answer table): cheap, so a batched step can ask them before it decides how
    long the rows' candidates are, and the shared drafter drafts after that decision."""
    got: list[dict[int, mx.array]] = [{} for _ in plans]
    _ask(plans, states, lengths, got, _in_host_pass)
    return got


def drafting_kind(plan: list[Slot], host: dict[int, mx.array]) -> str | None:
    """What kind of draft a row makes this step, given what its host sources proposed (`host_proposals`): that of
    the first of those that proposed (e.g. a copy from the context, by the length of the match: a source's `kind`,
    else its name), else the first shared source that will draft (the drafter), else None (the row verifies g0
    alone). Acceptance differs by far between these, so a batched step prices each row by it."""
    if host:
        source = plan[min(host)].source
        return getattr(source, "kind", source.name)
    return next((s.source.name for s in plan if s.width > 0 and not _in_host_pass(plan, s)), None)


def host_only(plan: list[Slot], host: dict[int, mx.array]) -> bool:
    """Whether a row's candidates this step are only those its host sources proposed (`host_proposals`): no
    shared source drafts after them (e.g. the drafter that only backs up a context copy)."""
    names = {plan[i].source.name for i in host}
    return bool(host) and (_exclusive(plan, host) or not any(
        s.width > 0 and not _in_host_pass(plan, s) and s.backs_up not in names for s in plan))


def _exclusive(plan: list[Slot], got: dict[int, mx.array]) -> bool:
    """Whether a source that proposed this step holds the row to its proposal (`exclusive`)."""
    return any(plan[i].source.exclusive for i in got)


def _in_host_pass(plan: list[Slot], slot: Slot) -> bool:
    """Asked before the shared sources: a host source, unless it backs up a shared one (it must wait for it)."""
    if getattr(slot.source, "batch_key", None) is not None:
        return False
    backed = next((s for s in plan if s.source.name == slot.backs_up), None)
    return backed is None or getattr(backed.source, "batch_key", None) is None


def _ask(plans: list[list[Slot]], states: list[DecodeState], lengths: list[int], got: list[dict[int, mx.array]],
         wanted) -> None:
    """Ask the `wanted(plan, slot)` slots of every row, backups after the others (whether a backup is asked
    depends on what those gave; one level: a backup does not back up a backup); adds to `got`."""
    for backups in (False, True):
        groups: dict[tuple, list[tuple[int, int]]] = {}
        for r, plan in enumerate(plans):
            for i, slot in enumerate(plan):
                if (slot.backs_up is not None) != backups or slot.width <= 0 or not wanted(plan, slot):
                    continue
                if any(plan[j].source.name == slot.backs_up for j in got[r]) or _exclusive(plan, got[r]):
                    continue
                key = getattr(slot.source, "batch_key", None)
                if key is None:
                    c = slot.source.propose(states[r], lengths[r], slot.width)
                    if c is not None:
                        got[r][i] = c
                else:
                    groups.setdefault((key, lengths[r], slot.width), []).append((r, i))
        for (_, length, width), members in groups.items():
            r0, i0 = members[0]
            src = plans[r0][i0].source  # one row alone asks `propose`, the entry point of a one-sequence step
            outs = ([src.propose(states[r0], length, width)] if len(members) == 1 else
                    src.propose_many([states[r] for r, _ in members], length, width))
            for (r, i), c in zip(members, outs):
                if c is not None:
                    got[r][i] = c


def _proposal(plan: list[Slot], got: dict[int, mx.array], state: DecodeState, length: int) -> Proposal:
    if not got:
        alone = mx.concatenate([state.g0.astype(mx.int32), mx.full((length - 1,), PAD, dtype=mx.int32)])[None]
        return Proposal(alone, [], chain=1)
    parts = [got[i] for i in sorted(got)]
    width = max(c.shape[1] for c in parts)
    parts = [c if c.shape[1] == width else mx.pad(c, [(0, 0), (0, width - c.shape[1])], constant_values=PAD)
             for c in parts]
    cands = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)
    one = len(got) == 1 and cands.shape[0] == 1 and not plan[next(iter(got))].source.pads
    return Proposal(cands, [(plan[i].source.name, got[i].shape[0]) for i in sorted(got)],
                    chain=cands.shape[1] if one else 0)


class Allocator:
    """Shares a step's candidates between sources.

    Fixed: every source proposes up to its width every step. Adaptive: a source that may sit out (`optional`,
    e.g. lookup, which only sometimes finds text worth copying) is left out while the drafts its best candidates
    had accepted, an exponential moving average, stay below `min_gain` per step (its candidates would only add
    verify cost), except on every `probe`-th step, so it comes back as soon as it is useful again. Sources the
    user sized (the drafter's W) always keep their width.
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
        return [Slot(s.source, 0) if s.source.optional and self.gain[s.source.name] < self.min_gain else s
                for s in self.slots]

    def update(self, runs: dict[str, int]) -> None:
        """Record the drafts each proposing source's best candidate had accepted in the last step."""
        for name, run in runs.items():
            self.gain[name] = self.decay * self.gain[name] + (1 - self.decay) * run

    @property
    def sources(self) -> list[DraftSource]:
        return [s.source for s in self.slots]

    def longest(self, length: int) -> int:
        """The longest candidate (g0 included) any of its sources proposes in steps of `length` (a copy may grow
        past `length`)."""
        return max((s.source.candidate_length(length) for s in self.slots), default=length)

    def candidate_budget(self, length: int) -> int:
        """The most candidate tokens a step of `length` may verify (sizes the cache's scratch region)."""
        return sum(s.width * s.source.candidate_length(length) for s in self.slots)
