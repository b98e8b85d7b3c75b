"""Drafts the grammar forces: under a JSON schema (constraint.py), the tokens that must come next (a key's name,
its quotes and colon, a `const`) are proposed as one candidate, so the target verifies them in one call instead of
deciding them one by one (SGLang's jump-forward, here as a draft: verified like any other, so exact)."""

from __future__ import annotations

import mlx.core as mx

from mlx_redrafter.draft.base import DecodeState, Source
from mlx_redrafter.tree import PAD

MAX_FORCED = 15  # forced tokens proposed in one step (a forced run is verified whole, however long the drafts are)


class GrammarSource(Source):
    """One candidate: g0 and the tokens the sequence's grammar forces after it (none without a grammar, or where
    it forces nothing)."""

    name = "grammar"

    def candidate_length(self, length: int) -> int:
        return max(length, MAX_FORCED + 1)

    def propose(self, state: DecodeState, length: int, width: int) -> mx.array | None:
        if state.constraint is None or width < 1:
            return None
        forced = state.constraint.forced()[:MAX_FORCED]
        if not forced:
            return None
        row = [state.tokens[-1], *forced]
        return mx.array([row + [PAD] * (self.candidate_length(length) - len(row))], dtype=mx.int32)
