"""Lookup drafting: continuations copied from earlier in the context (prompt + everything generated so far),
or from the target's own answers to other prompts.

Two context indices, both updated incrementally as tokens are decided (O(1) amortised per token, host-side ints):
- `NgramIndex`: prompt lookup. The last n tokens (n = max_n .. min_n) are looked up among earlier n-grams;
  the tokens that followed their most recent occurrences are the candidates.
- `SuffixIndex`: a suffix automaton. It finds the longest earlier occurrence of any suffix of the context
  (no n limit), then shorter ones along its suffix links; each gives one candidate (what followed it).
Both return distinct continuations, longest match first.

`AnswerTable` is a fixed table of the target's greedy answers to training prompts (shipped beside a model's
drafter as answers.npz, built by `redrafter-mlx answers`); `AnswerIndex` is one decode's view of it. A small
model reuses its own phrasing across answers, so what followed the context's last n tokens there is often
what it writes next here; it backs up context lookup (it proposes in steps where the context has nothing to copy).

`PredictionIndex` copies from a predicted output (OpenAI's `prediction`: text the answer is expected to repeat
largely, e.g. the code being edited): from its start while the answer follows it, and after any change from where
the answer's last tokens occur in it again.

`LookupSource` turns any of these indices into a draft source; `INDEXES` names the context indices the options
choose from.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable
from functools import partial
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_redrafter.draft.base import PAD, DecodeState
from mlx_redrafter.errors import UserError


class NgramIndex:
    """n-gram -> end positions of its occurrences, for n in [min_n, max_n]."""

    def __init__(self, max_n: int = 4, min_n: int = 1):
        self.max_n, self.min_n = max_n, min_n
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], list[int]] = {}
        self.matched = 0  # tokens of the match the last `candidates` copied after (0: none)

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            self.tokens.append(t)
            i = len(self.tokens) - 1
            for n in range(self.min_n, self.max_n + 1):
                if i - n + 1 < 0:
                    break
                self.ends.setdefault(tuple(self.tokens[i - n + 1 : i + 1]), []).append(i)

    def candidates(self, max_len: int, width: int) -> list[list[int]]:
        """Up to `width` distinct continuations (1..max_len tokens) of the context's last n-gram."""
        toks, last = self.tokens, len(self.tokens) - 1
        out: list[list[int]] = []
        seen: set[tuple[int, ...]] = set()
        self.matched = 0
        for n in range(min(self.max_n, len(toks)), self.min_n - 1, -1):
            for end in reversed(self.ends.get(tuple(toks[last - n + 1 :]), ())):
                if end >= last:
                    continue  # the context's own suffix
                cont = tuple(toks[end + 1 : end + 1 + max_len])
                if cont and cont not in seen:
                    seen.add(cont)
                    out.append(list(cont))
                    self.matched = self.matched or n
                    if len(out) == width:
                        return out
        return out


class SuffixIndex:
    """Online suffix automaton over the context's tokens (Blumer et al.), with first end positions."""

    def __init__(self, min_len: int = 1):
        self.min_len = min_len
        self.tokens: list[int] = []
        self.length = [0]
        self.link = [-1]
        self.next: list[dict[int, int]] = [{}]
        self.first_end = [-1]
        self.last = 0
        self.matched = 0  # tokens of the match the last `candidates` copied after (0: none)

    def _new(self, length: int, link: int, nxt: dict[int, int], first_end: int) -> int:
        self.length.append(length)
        self.link.append(link)
        self.next.append(nxt)
        self.first_end.append(first_end)
        return len(self.length) - 1

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            self.tokens.append(t)
            i = len(self.tokens) - 1
            cur = self._new(self.length[self.last] + 1, -1, {}, i)
            p = self.last
            while p != -1 and t not in self.next[p]:
                self.next[p][t] = cur
                p = self.link[p]
            if p == -1:
                self.link[cur] = 0
            else:
                q = self.next[p][t]
                if self.length[p] + 1 == self.length[q]:
                    self.link[cur] = q
                else:
                    clone = self._new(self.length[p] + 1, self.link[q], dict(self.next[q]), self.first_end[q])
                    while p != -1 and self.next[p].get(t) == q:
                        self.next[p][t] = clone
                        p = self.link[p]
                    self.link[q] = self.link[cur] = clone
            self.last = cur

    def candidates(self, max_len: int, width: int) -> list[list[int]]:
        """Continuations of the longest earlier occurrences of the context's suffixes, longest first."""
        out: list[list[int]] = []
        seen: set[tuple[int, ...]] = set()
        v = self.link[self.last]
        self.matched = 0
        while v > 0 and self.length[v] >= self.min_len and len(out) < width:
            end = self.first_end[v]
            cont = tuple(self.tokens[end + 1 : end + 1 + max_len])
            if cont and cont not in seen:
                seen.add(cont)
                out.append(list(cont))
                self.matched = self.matched or self.length[v]
            v = self.link[v]
        return out


_MUL = np.uint64(0x9E3779B97F4A7C15)  # multiplier of the n-gram hash (odd: a bijection per step)


def _ngram_keys(tokens: np.ndarray, n: int) -> np.ndarray:
    """keys[i] = hash of tokens[i : i + n] (uint64)."""
    t = tokens.astype(np.uint64) + np.uint64(1)
    keys = np.zeros(len(tokens) - n + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(n):
            keys = keys * _MUL + t[j : len(tokens) - n + 1 + j]
    return keys


class AnswerTable:
    """n-gram (n = max_n .. min_n) -> where it occurs in a fixed corpus of answers; read-only, shared by decodes.

    `tokens`: the answers concatenated, each followed by -1. Candidates for a context: at its longest last
    n-gram found in the corpus, up to `width` continuations, one per most frequent next token, each extended
    by the most frequent next token among the occurrences that agree so far and go on. (A hash collision only
    costs a wasted draft: the target verifies every draft.)
    """

    def __init__(self, tokens: np.ndarray, max_n: int = 4, min_n: int = 2, max_hits: int = 512,
                 meta: dict | None = None):
        self.max_n, self.min_n, self.max_hits, self.meta = max_n, min_n, max_hits, meta or {}
        self.tokens = np.concatenate([np.asarray(tokens, dtype=np.int32), [-1]])
        gap = self.tokens < 0
        self.tables: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for n in range(min_n, max_n + 1):
            keys = _ngram_keys(self.tokens, n)
            bad = np.zeros(len(keys), dtype=bool)
            for j in range(n + 1):  # a gap inside the n-gram or right after it (nothing to copy)
                bad[: len(keys) - (j == n)] |= gap[j : j + len(keys) - (j == n)]
            ends = np.flatnonzero(~bad) + n - 1  # position of each kept n-gram's last token
            order = np.argsort(keys[~bad], kind="stable")
            self.tables[n] = (keys[~bad][order], ends[order])

    @classmethod
    def load(cls, path: str | Path, vocab_size: int | None = None) -> AnswerTable:
        """Read answers.npz (`redrafter-mlx answers`); a file that is not one, or holds ids outside the
        vocabulary, is a one-line UserError."""
        fix = "rebuild it with `redrafter-mlx answers` or delete it"
        try:
            with np.load(path) as z:
                tokens = z["tokens"]
                meta = json.loads(str(z["meta"])) if "meta" in z.files else None
        except (OSError, ValueError, KeyError, EOFError, json.JSONDecodeError) as e:
            raise UserError(f"answer table {path} cannot be read ({e}): {fix}") from None
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise UserError(f"answer table {path}: 'tokens' must be a 1-D integer array (got {tokens.dtype}, "
                            f"{tokens.ndim}-D): {fix}")
        if len(tokens) and (tokens.min() < -1 or (vocab_size is not None and tokens.max() >= vocab_size)):
            raise UserError(f"answer table {path} holds token ids from {tokens.min()} to {tokens.max()}, outside "
                            f"the model's vocabulary (0..{vocab_size}, -1 between answers): {fix}")
        return cls(tokens, meta=meta if isinstance(meta, dict) else None)

    def candidates(self, context: list[int], max_len: int, width: int) -> list[list[int]]:
        """Up to `width` distinct continuations (1..max_len tokens) of the context's longest known last n-gram."""
        for n in range(min(self.max_n, len(context)), self.min_n - 1, -1):
            keys, ends = self.tables[n]
            k = _ngram_keys(np.asarray(context[-n:]), n)[0]
            lo, hi = int(np.searchsorted(keys, k, "left")), int(np.searchsorted(keys, k, "right"))
            if hi == lo:
                continue
            hits = ends[lo : min(hi, lo + self.max_hits)]
            at = np.minimum(hits[:, None] + 1 + np.arange(max_len)[None, :], len(self.tokens) - 1)
            follow = self.tokens[at]  # (hits, max_len); -1: the answer ended
            firsts, counts = np.unique(follow[:, 0], return_counts=True)
            out = []
            for first in firsts[np.argsort(-counts, kind="stable")][:width]:
                rows, cand = follow[follow[:, 0] == first], [int(first)]
                for d in range(1, max_len):
                    rows = rows[rows[:, d] >= 0]  # occurrences whose answer goes on
                    if not len(rows):
                        break
                    vals, cnt = np.unique(rows[:, d], return_counts=True)
                    best = vals[np.argmax(cnt)]
                    cand.append(int(best))
                    rows = rows[rows[:, d] == best]
                out.append(cand)
            return out
        return []


class AnswerIndex:
    """One decode's view of an `AnswerTable`, with the interface of the context indices."""

    def __init__(self, table: AnswerTable):
        self.table = table
        self.tokens: deque[int] = deque(maxlen=table.max_n)  # the context's last max_n tokens

    def extend(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)

    def candidates(self, max_len: int, width: int) -> list[list[int]]:
        return self.table.candidates(list(self.tokens), max_len, width)


class PredictionIndex:
    """One decode's view of a predicted output (token ids), with the interface of the context indices. The first
    `extend` is the context and the answer's first token (`Source.start`: g0 last); the answer follows the
    prediction while its tokens are the prediction's, from its start; once they differ, its last 2-4 tokens are
    looked up in the prediction to find where to copy from next."""

    def __init__(self, prediction: list[int]):
        self.prediction = prediction
        self.table = AnswerTable(np.asarray(prediction, dtype=np.int32))
        self.tokens: deque[int] = deque(maxlen=self.table.max_n)  # the context's last max_n tokens
        self.at: int | None = None  # the prediction's next token while the answer follows it (None: it left it)
        self.started = False  # the context before the answer came
        self.matched = 0

    def extend(self, tokens: list[int]) -> None:
        if not self.started:  # the context, then the answer's first token
            self.started = True
            self.at = 1 if tokens and self.prediction and tokens[-1] == self.prediction[0] else None
        else:
            for t in tokens:
                follows = self.at is not None and self.at < len(self.prediction) and self.prediction[self.at] == t
                self.at = self.at + 1 if follows else None
        self.tokens.extend(tokens)

    def candidates(self, max_len: int, width: int) -> list[list[int]]:
        if self.at is not None and self.at < len(self.prediction):
            self.matched = LookupSource.KIND_MATCH
            return [self.prediction[self.at : self.at + max_len]]
        found = self.table.candidates(list(self.tokens), max_len, width)
        self.matched = self.table.min_n if found else 0
        return found


# Context lookup indices by name; the "2" variants copy only after a match of at least two tokens (fewer, better
# drafts).
INDEXES: dict[str, Callable[[], object]] = {
    "ngram": partial(NgramIndex, 4, 1), "ngram2": partial(NgramIndex, 4, 2), "suffix": SuffixIndex,
    "suffix2": partial(SuffixIndex, 2)}


class LookupSource:
    """Training-free drafts copied by an index of this module, kept in step with the decided tokens.

    With `max_length` above the step's length, a copy that keeps being accepted grows: after a step whose decided
    tokens were all the copy's (it accepted every token this source proposed, or every one a batched step
    verified of them), its next candidates may copy twice as many, up to `max_length` tokens (g0 included); any
    other step sets them back to the step's length (long copies only where the text is being copied).
    """

    optional = True  # may sit out (Allocator) when it keeps finding nothing worth verifying
    pads = False  # one copy is never padded
    KIND_MATCH = 4  # matches of at least this many tokens are one kind of draft (`kind`)

    def __init__(self, index_factory: Callable[[], object], name: str = "lookup", max_length: int = 0,
                 exclusive_match: int = 0):
        """`exclusive_match` > 0: a copy after a match of at least this many tokens is the row's only candidate of
        the step (`exclusive`; for a prediction the answer is following)."""
        self.factory, self.name, self.max_length = index_factory, name, max_length
        self.exclusive_match = exclusive_match
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
        # every decided token was the copy's: all of it was accepted, or a batched step verified only its start
        copied = any(len(c) == self.asked and tokens[: len(c)] == c[: len(tokens)] for c in self.proposed)
        self.grown = 2 * self.asked if copied else 0
        self.proposed = []

    def candidate_length(self, length: int) -> int:
        return max(length, self.max_length)

    @property
    def exclusive(self) -> bool:
        matched = getattr(self.index, "matched", 0)
        return bool(self.exclusive_match and self.proposed and matched >= self.exclusive_match)

    @property
    def kind(self) -> str:
        """The kind of draft of the last proposal, for pricing a step by its acceptance: the source's name and
        the length of the match it copied after (a copy after a longer match is accepted far more often)."""
        matched = getattr(self.index, "matched", 0)
        return f"{self.name}{min(matched, self.KIND_MATCH)}" if matched else self.name

    def propose(self, state: DecodeState, length: int, width: int) -> mx.array | None:
        self.asked = min(max(length - 1, self.grown), self.candidate_length(length) - 1)
        self.proposed = self.index.candidates(self.asked, width)
        if not self.proposed:
            return None
        longest = max(len(c) for c in self.proposed)  # so one copy is never padded
        rows = [[state.tokens[-1], *c] + [PAD] * (longest - len(c)) for c in self.proposed]
        return mx.array(rows, dtype=mx.int32)
