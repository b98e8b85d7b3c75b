"""Lookup drafting: continuations copied from earlier in the context (prompt + everything generated so far).

Two indices, both updated incrementally as tokens are decided (O(1) amortised per token, host-side ints):
- `NgramIndex`: prompt lookup. The last n tokens (n = max_n .. min_n) are looked up among earlier n-grams;
  the tokens that followed their most recent occurrences are the candidates.
- `SuffixIndex`: a suffix automaton. It finds the longest earlier occurrence of any suffix of the context
  (no n limit), then shorter ones along its suffix links; each gives one candidate (what followed it).
Both return distinct continuations, longest match first.
"""

from __future__ import annotations


class NgramIndex:
    """n-gram -> end positions of its occurrences, for n in [min_n, max_n]."""

    def __init__(self, max_n: int = 4, min_n: int = 1):
        self.max_n, self.min_n = max_n, min_n
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], list[int]] = {}

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
        for n in range(min(self.max_n, len(toks)), self.min_n - 1, -1):
            for end in reversed(self.ends.get(tuple(toks[last - n + 1 :]), ())):
                if end >= last:
                    continue  # the context's own suffix
                cont = tuple(toks[end + 1 : end + 1 + max_len])
                if cont and cont not in seen:
                    seen.add(cont)
                    out.append(list(cont))
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
        while v > 0 and self.length[v] >= self.min_len and len(out) < width:
            end = self.first_end[v]
            cont = tuple(self.tokens[end + 1 : end + 1 + max_len])
            if cont and cont not in seen:
                seen.add(cont)
                out.append(list(cont))
            v = self.link[v]
        return out
