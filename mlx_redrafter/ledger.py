"""Per-function timing ledger for MLX code (in the spirit of Apple's `time_mlx`).

MLX is lazy: timing a function without evaluating its result measures graph building only. While a
ledger is active, every timed function evaluates what it returns (`mx.eval`) before its clock stops, so
the time is the real cost of that function. That also splits MLX's graph at every timed boundary, which
costs a little speed: profile in a separate run, never inside the run whose tokens/s you report.
When no ledger is active the wrappers call straight through (one global lookup of overhead).

API:
    @timed("beam_search")            # decorator for functions returning arrays (or tuples/lists/dicts of them)
    with span("verify") as s:        # block timer; s.eval(*arrays) marks what the block produced
        ...; s.eval(logits, hidden)
    record("name", seconds)          # add a time measured elsewhere
    with Ledger() as led: ...        # collect; led.rows(), led.table(), led.as_dict()
    with instrument({module: ["fn", ...], Class: ["method", ...]}): ...   # wrap existing functions
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import mlx.core as mx

F = TypeVar("F", bound=Callable[..., Any])
_active: list[Ledger] = []


def _arrays(tree: Any) -> list[mx.array]:
    """All mx.arrays in a (nested) tuple/list/dict/dataclass-free result."""
    if isinstance(tree, mx.array):
        return [tree]
    if isinstance(tree, (tuple, list)):
        return [a for x in tree for a in _arrays(x)]
    if isinstance(tree, dict):
        return [a for x in tree.values() for a in _arrays(x)]
    fields = getattr(tree, "__dataclass_fields__", None)
    if fields:
        return [a for name in fields for a in _arrays(getattr(tree, name))]
    return []


@dataclass
class Entry:
    """Accumulated wall time of one name."""

    calls: int = 0
    total_s: float = 0.0
    min_s: float = float("inf")
    max_s: float = 0.0

    def add(self, seconds: float) -> None:
        self.calls += 1
        self.total_s += seconds
        self.min_s = min(self.min_s, seconds)
        self.max_s = max(self.max_s, seconds)


class Ledger:
    """Collects (name -> calls, total, min, max) while active (`with Ledger() as led:`)."""

    def __init__(self) -> None:
        self.entries: dict[str, Entry] = {}
        self.wall_s = 0.0
        self._t0 = 0.0

    def __enter__(self) -> Ledger:
        _active.append(self)
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.wall_s += time.perf_counter() - self._t0
        _active.remove(self)

    def add(self, name: str, seconds: float) -> None:
        self.entries.setdefault(name, Entry()).add(seconds)

    def rows(self) -> list[dict[str, Any]]:
        """One dict per name, largest total first; share = total / ledger wall time."""
        out = []
        for name, e in sorted(self.entries.items(), key=lambda kv: -kv[1].total_s):
            out.append({
                "name": name, "calls": e.calls, "total_s": round(e.total_s, 5),
                "mean_ms": round(1e3 * e.total_s / e.calls, 3) if e.calls else 0.0,
                "min_ms": round(1e3 * e.min_s, 3) if e.calls else 0.0, "max_ms": round(1e3 * e.max_s, 3),
                "share": round(e.total_s / self.wall_s, 4) if self.wall_s > 0 else 0.0,
            })
        return out

    def as_dict(self) -> dict[str, Any]:
        return {"wall_s": round(self.wall_s, 5), "entries": self.rows()}

    def table(self) -> str:
        """Plain-text table (names may nest: timed functions called inside timed functions count in both)."""
        lines = [f"{'function':<28}{'calls':>7}{'total s':>10}{'mean ms':>10}{'min ms':>10}{'max ms':>10}{'share':>8}"]
        for r in self.rows():
            lines.append(f"{r['name']:<28}{r['calls']:>7}{r['total_s']:>10.3f}{r['mean_ms']:>10.2f}"
                         f"{r['min_ms']:>10.2f}{r['max_ms']:>10.2f}{100 * r['share']:>7.1f}%")
        lines.append(f"{'(ledger wall time)':<28}{'':>7}{self.wall_s:>10.3f}")
        return "\n".join(lines)


def active() -> Ledger | None:
    """The innermost active ledger, or None (then timing is off)."""
    return _active[-1] if _active else None


def record(name: str, seconds: float) -> None:
    """Add an externally measured time to the active ledger (no-op when none)."""
    if _active:
        _active[-1].add(name, seconds)


def timed(name: str | None = None) -> Callable[[F], F]:
    """Decorator: while a ledger is active, evaluate the function's array outputs and record its wall time."""

    def deco(fn: F) -> F:
        label = name or fn.__qualname__

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not _active:
                return fn(*args, **kwargs)
            led = _active[-1]
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            arrs = _arrays(out)
            if arrs:
                mx.eval(*arrs)
            led.add(label, time.perf_counter() - t)
            return out

        wrapper.__ledger_wrapped__ = fn  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return deco


class _Span:
    def __init__(self) -> None:
        self.outputs: list[mx.array] = []

    def eval(self, *values: Any) -> None:
        """Mark what the block produced: evaluated before the span's clock stops (only when timing)."""
        if _active:
            self.outputs.extend(_arrays(list(values)))


@contextmanager
def span(name: str) -> Iterator[_Span]:
    """Time a block; call `s.eval(...)` on its outputs so lazy work is counted inside the block."""
    s = _Span()
    if not _active:
        yield s
        return
    led = _active[-1]
    t = time.perf_counter()
    yield s
    if s.outputs:
        mx.eval(*s.outputs)
    led.add(name, time.perf_counter() - t)


@contextmanager
def instrument(targets: dict[Any, list[str] | dict[str, str]]) -> Iterator[None]:
    """Temporarily wrap existing attributes with `timed`: {module_or_class: ["attr", ...] or {"attr": "label"}}.

    For code that does not call `timed` itself yet. Patches the attribute where it is looked up (e.g. the
    name a module imported with `from x import f`), restores everything on exit. Attributes already decorated
    with `timed` are left alone (they record under their own name).
    """
    saved: list[tuple[Any, str, Any]] = []
    try:
        for owner, attrs in targets.items():
            labels = attrs if isinstance(attrs, dict) else {a: None for a in attrs}
            for attr, label in labels.items():
                orig = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
                if hasattr(orig, "__ledger_wrapped__"):
                    continue  # already decorated with @timed where it is defined
                default = f"{getattr(owner, '__name__', type(owner).__name__).rsplit('.', 1)[-1]}.{attr}"
                saved.append((owner, attr, orig))
                setattr(owner, attr, timed(label or default)(orig))
        yield
    finally:
        for owner, attr, orig in reversed(saved):
            setattr(owner, attr, orig)
