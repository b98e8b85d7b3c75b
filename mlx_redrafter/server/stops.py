"""Stop strings over streamed text: text is released as soon as it cannot be the start of a stop string, and the
stop string itself (and anything after it) never is."""

from __future__ import annotations

Pieces = list[tuple[str, str]]  # (text, origin)


class StopText:
    """Holds back the shortest tail that could begin a stop string; `add` returns what may be sent now."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.held: Pieces = []
        self.done = False

    def add(self, pieces: Pieces) -> tuple[Pieces, bool]:
        """(pieces to send, whether a stop string was found)."""
        if self.done:
            return [], True
        self.held += [p for p in pieces if p[0]]
        text = "".join(t for t, _ in self.held)
        if not self.stops:
            out, self.held = self.held, []
            return out, False
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if found:
            self.done = True
            out, self.held = _split(self.held, min(found))[0], []
            return out, True
        keep = max((k for s in self.stops for k in range(1, min(len(s), len(text) + 1))
                    if text.endswith(s[:k])), default=0)
        out, self.held = _split(self.held, len(text) - keep)
        return out, False

    def flush(self) -> Pieces:
        """Whatever is still held (the answer ended without a stop string)."""
        out, self.held = ([] if self.done else self.held), []
        return out


def _split(pieces: Pieces, at: int) -> tuple[Pieces, Pieces]:
    """Pieces before and after character `at` of their concatenated text."""
    head, tail, pos = [], [], 0
    for text, origin in pieces:
        if pos + len(text) <= at:
            head.append((text, origin))
        elif pos >= at:
            tail.append((text, origin))
        else:
            head.append((text[: at - pos], origin))
            tail.append((text[at - pos:], origin))
        pos += len(text)
    return [p for p in head if p[0]], [p for p in tail if p[0]]
