"""How many tokens each row of a batched step verifies: the candidate length that maximises the tokens the
batch is expected to decide per second of target call.

On a CPU (and a GPU at small batches) a forward over B rows of P tokens costs little more than over B rows of 1
until B x P reaches the point where the products stop being bound by reading the weights; past it the cost grows
with every token. Speculation spends that flat part: a row whose drafts are often accepted gains from a longer
candidate, a batch of rows whose drafts are rejected loses. `CostCurve` is that cost, measured on this machine for
this model (`stored_curve` / `measured_curve`: measured once, at the first batched run, and kept beside the tuned
settings; `python -m bench curve` measures and plots it); `Budget` reads it with each row's recent acceptance of
the kind of draft it has this step (a context copy or the drafter's) and picks, every step, one candidate length
for the drafting rows (1 = a plain batched step: speculation backs off).
"""

from __future__ import annotations

import json
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from mlx_redrafter.files import read_json, write_atomic


@dataclass
class CostCurve:
    """Seconds of one batched target call, per batch size B, for P = 1, 2, ... tokens per row."""

    seconds: dict[int, list[float]]
    context: int = 0  # committed tokens per row when measured
    meta: dict = field(default_factory=dict)

    def cost(self, rows: int, tokens: int) -> float:
        """Seconds for `rows` rows of `tokens` tokens: the nearest measured batch size (the next larger one
        scaled when `rows` is beyond the curve), linear between measured lengths and past the last."""
        sizes = sorted(self.seconds)
        b = min((s for s in sizes if s >= rows), default=sizes[-1])
        curve = self.seconds[b]
        scale = rows / b if rows > b else 1.0
        if tokens <= len(curve):
            return curve[tokens - 1] * scale
        slope = curve[-1] - curve[-2] if len(curve) > 1 else curve[-1]
        return (curve[-1] + slope * (tokens - len(curve))) * scale

    @classmethod
    def measure(cls, model, batches: list[int], max_tokens: int, context: int = 128, repeats: int = 3,
                progress=None) -> CostCurve:
        """Time one forward of B rows x P tokens over `context` committed tokens per row, for every B in
        `batches` and P in 1..max_tokens: the median of `repeats` rounds that each visit every cell once (after
        one unmeasured round), so a change in the machine's speed during the measurement (memory bandwidth
        shared with other tenants moves a forward by +-20% here) touches every cell alike."""
        from mlx_redrafter.batch.cache import RowsCache

        one = model.make_cache(context)
        model(mx.zeros((1, context), dtype=mx.int32), one)
        one.advance(context)
        mx.eval(*one.state())
        caches = {}
        for b in batches:
            caches[b] = RowsCache(model.args.num_hidden_layers, context + max_tokens)
            for _ in range(b):
                caches[b].join(one)
            mx.eval(*caches[b].state())
        cells = [(b, p) for b in batches for p in range(1, max_tokens + 1)]

        def forward_s(b: int, p: int) -> float:  # forwards write scratch entries only: caches stay as joined
            mask = mx.ones((b, 1, p, context + p), dtype=mx.bool_)
            pos = mx.broadcast_to(mx.arange(context, context + p), (b, p))
            t = time.perf_counter()
            mx.eval(*model(mx.zeros((b, p), dtype=mx.int32), caches[b], pos, mask))
            return time.perf_counter() - t

        times: dict[tuple[int, int], list[float]] = {c: [] for c in cells}
        for r in range(repeats + 1):
            for b, p in cells:
                t = forward_s(b, p)
                if r:
                    times[(b, p)].append(t)
            if progress:
                progress(r, repeats)
        return cls({b: [statistics.median(times[(b, p)]) for p in range(1, max_tokens + 1)] for b in batches},
                   context)

    def to_dict(self) -> dict:
        return {"seconds": {str(b): [round(s, 6) for s in v] for b, v in self.seconds.items()},
                "context": self.context, "meta": self.meta}

    @classmethod
    def from_dict(cls, d: dict) -> CostCurve:
        return cls({int(b): [float(s) for s in v] for b, v in d["seconds"].items()}, int(d.get("context", 0)),
                   dict(d.get("meta", {})))

    def save(self, path: Path) -> None:
        write_atomic(Path(path), json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> CostCurve:
        from mlx_redrafter.errors import UserError

        d = read_json(Path(path), "cost curve")
        try:
            curve = cls.from_dict(d)
            ok = curve.seconds and all(v and all(s > 0 for s in v) for v in curve.seconds.values())
        except (KeyError, TypeError, ValueError, AttributeError):
            ok = False
        if not ok:
            raise UserError(f"{path}: not a cost curve ({{'seconds': {{batch: [seconds per P = 1, 2, ...]}}}}): "
                            f"measure one with `python -m bench curve`")
        return curve


class Budget:
    """Per step, the candidate length of each row (see the module docstring).

    A row's drafts are modelled as accepted one after another with probability alpha, so a candidate of length l
    decides (1 - alpha**l) / (1 - alpha) tokens on average. Alpha is kept per kind of draft, over every row (an
    exponential moving average over the drafts verified, each weighing `acceptance_decay`): the kind is what a row
    drafts from this step (`draft.base.drafting_source`: a copy from its context, which the target often accepts for
    many tokens, or the drafter, which it accepts far less), known before the step is priced because copies are
    looked up first. The rows of a batch draft from the same sources, and one row's last few drafts are too few to
    price a step by (an alpha per row let a few rejected drafts send the batch to plain steps, where only rare
    probes correct it). Without a curve every drafting row gets the full `length`. With one, the length l in
    1..length (1: a plain step) that maximises the batch's expected tokens per second. Costs are measured in this
    run, relative to plain steps: `ratio(rows, l)` is what a step of length l cost over the plain step run right
    before or after it (the median of the last `RATIO_WINDOW` such neighbours: one step slowed by something else,
    such as the cache growing, must not keep the batch from speculating until the next probes wash it out), and
    `plain[rows]` what a plain step costs now (every step updates it: a step of length l through its ratio).
    Neighbouring steps see the same contexts, so a ratio stays valid as the contexts grow, where an absolute time
    measured many steps ago would not; drafting, packing and acceptance, which the curve does not hold, are in it. A
    length without a measured ratio takes the curve's ratio to the nearest measured one. The first step at a batch
    size is plain (the reference). A step tries the other kind of step (2 drafted tokens while backed off, a plain
    step otherwise) when there has been none for a while, so the acceptance and the costs stay current: `probe`
    steps at first, twice as long after each probe (at most `max_probe`), back to `probe` when the choice changes
    while the rows draft from the same kinds (a change of mind, not of situation). A batch where one kind of step
    keeps winning spends little on the other; one that alternates with what its rows copy needs no probes.
    """

    def __init__(self, length: int, curve: CostCurve | None = None, decay: float = 0.8, prior: float = 0.5,
                 probe: int = 12, max_probe: int = 96, copy_length: int | None = None,
                 acceptance_decay: float = 0.95):
        self.length, self.curve, self.decay, self.prior = length, curve, decay, prior
        self.acceptance_decay = acceptance_decay
        self.copy_length = max(copy_length or length, length)
        self.probe, self.max_probe = probe, max_probe
        self.alpha: dict[str, float] = {}  # kind of draft -> acceptance, over every row
        self.caps: list[int] = []  # each row's longest candidate
        self.step_caps: list[int] = []  # each row's longest candidate at the last step (copies may be longer)
        self.plain: dict[int, float] = {}  # rows -> seconds of a plain step now (moving average)
        self.ratios: dict[tuple[int, int], deque[float]] = {}  # (rows, length > 1) -> its last pairs' cost ratios
        self.previous: tuple[int, int, float] | None = None  # (rows, length, seconds) of the last observed step
        self.steps = 0
        self.last: tuple[int, int] = (0, 1)  # (rows, common length) of the last step
        self.kinds: list[str | None] = []  # each row's kind of draft at the last step
        self.speculating = False  # whether the model chose to draft at the last step
        self.situation: list[str | None] = []  # the kinds of draft it chose for
        self.last_plain = self.last_speculative = 0  # the last step of each kind
        self.interval = probe

    @property
    def caps_candidates(self) -> bool:
        """Whether the lengths given are hard caps (with a curve: the cost was computed for them) rather than the
        length sources start from (a context copy that keeps being accepted may grow past it)."""
        return self.curve is not None

    def join(self, cap: int | None = None) -> None:
        """A row joins; its candidates are at most `cap` tokens (default: `length`)."""
        self.caps.append(min(cap or self.length, self.length))

    def select(self, keep: list[int]) -> None:
        self.caps = [self.caps[i] for i in keep]

    def acceptance(self, kind: str) -> float:
        """Alpha of this kind of draft (the prior until a row has drafted so)."""
        return self.alpha.get(kind, self.prior)

    def expected(self, alpha: float, length: int) -> float:
        """Tokens a candidate of `length` decides on average (the target's own token included)."""
        return float(length) if alpha >= 1 else (1 - alpha**length) / (1 - alpha)

    def ratio(self, rows: int, length: int) -> float:
        """A measured step of `length` over a neighbouring plain step: the median of its last pairs."""
        return statistics.median(self.ratios[rows, length])

    def cost(self, rows: int, length: int) -> float:
        """Expected seconds of a step of `rows` rows at a common candidate length (plain steps of this many rows
        must have been measured)."""
        base = self.plain[rows]
        if length == 1:
            return base
        measured = [n for r, n in self.ratios if r == rows]
        if not measured:
            return base * self.curve.cost(rows, length) / self.curve.cost(rows, 1)
        nearest = min(measured, key=lambda n: (abs(n - length), n))
        return base * self.ratio(rows, nearest) * self.curve.cost(rows, length) / self.curve.cost(rows, nearest)

    def lengths(self, kinds: list[str | None], fixed: list[bool] | None = None,
                offered: list[int | None] | None = None) -> list[int]:
        """The candidate length of each row this step, given what each drafts from (None: nothing; it gets 1) and,
        for a row whose only candidates are copies, the longest one (`offered`, tokens with g0; None otherwise): a
        row at the full length may take a copy of up to `copy_length` (a copy that keeps being accepted grows), a
        shorter copy prices the row by its own length. `fixed` rows always get their
        cap: a sampling row whose drafts must not depend on the other rows (its seeded output depends on what it
        drafts, not only on the target), while greedy rows' output never does."""
        offered = offered or [None] * len(kinds)
        self.step_caps = [c if o is None else min(o, c if c < self.length else self.copy_length)
                          for c, o in zip(self.caps, offered)]
        self.kinds = list(kinds)
        best = self._common(kinds)
        self.last = (len(kinds), best)
        if best > 1:
            self.last_speculative = self.steps
        else:
            self.last_plain = self.steps
        fixed = fixed or [False] * len(kinds)
        return [(c if f else min(best, s)) if k is not None else 1
                for c, s, k, f in zip(self.caps, self.step_caps, kinds, fixed)]

    def _common(self, kinds: list[str | None]) -> int:
        self.steps += 1
        drafting = [(r, k) for r, k in enumerate(kinds) if k is not None]
        if not drafting:
            return 1
        if self.curve is None:
            return self.length
        rows = len(kinds)
        if rows not in self.plain:
            return 1  # the reference: plain steps at this batch size, measured first
        alphas = [(self.acceptance(k), self.step_caps[r]) for r, k in drafting]

        def rate(n: int) -> float:
            gain = rows - len(alphas) + sum(self.expected(a, min(n, c)) for a, c in alphas)
            return gain / self.cost(rows, n)

        longest = max(c for _, c in alphas)  # no row drafts more than its cap
        best = max(range(1, longest + 1), key=rate)
        if (best > 1) != self.speculating and kinds == self.situation:  # a change of mind: probe soon again
            self.interval = self.probe
        self.speculating, self.situation = best > 1, list(kinds)
        since = self.steps - (self.last_plain if best > 1 else self.last_speculative)
        if since >= self.interval:  # try the other kind now and then, so the measurements stay current
            self.interval = min(2 * self.interval, self.max_probe)
            return min(2, longest) if best == 1 else 1
        return best

    def observe(self, lengths: list[int], accepted: list[int], seconds: float | None = None) -> None:
        """What the step's rows accepted (drafts) with the lengths they were given, and what the step cost."""
        for r, (n, a) in enumerate(zip(lengths, accepted)):
            kind = self.kinds[r]
            if n <= 1 or kind is None:
                continue
            n = min(n, self.step_caps[r])  # a shorter copy had no more drafts
            trials = a + (a < n - 1)  # accepted drafts, then the rejected one (if the run ended early)
            if trials:
                keep = self.acceptance_decay**trials
                self.alpha[kind] = keep * self.acceptance(kind) + (1 - keep) * a / trials
        rows, n = self.last
        if seconds is None or self.curve is None or not rows or seconds <= 0:
            return
        before, self.previous = self.previous, (rows, n, seconds)
        if before is not None and before[0] == rows and (before[1] == 1) != (n == 1):  # a plain / speculative pair
            length, ratio = (n, seconds / before[2]) if n > 1 else (before[1], before[2] / seconds)
            self.ratios.setdefault((rows, length), deque(maxlen=RATIO_WINDOW)).append(ratio)
        if n == 1:
            self.plain[rows] = self._average(self.plain.get(rows), seconds)
        elif rows in self.plain:
            self.plain[rows] = self._average(self.plain[rows], seconds * self.plain[rows] / self.cost(rows, n))

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else self.decay * old + (1 - self.decay) * new


MEASURED_BATCHES = 8  # the largest batch a curve measures; larger ones scale its cost
RATIO_WINDOW = 5  # plain / speculative pairs behind each measured cost ratio (their median)
CURVE_VERSION = 2  # bumped when the target forward's cost changes shape, so that kept curves are measured again


def curve_file(model: str, fingerprint: str) -> Path:
    """Where the measured curve of a model on this machine is kept (beside the tuned settings)."""
    from mlx_redrafter.tuning import tuned_file

    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in f"{model}-{fingerprint}")
    return tuned_file().parent / f"cost-curve-{safe}-v{CURVE_VERSION}.json"


def stored_curve(model: str, fingerprint: str, batch: int, length: int) -> CostCurve | None:
    """The kept curve if it covers batches up to `batch` and `length` tokens per row, else None."""
    path = curve_file(model, fingerprint)
    if not path.exists():
        return None
    curve = CostCurve.load(path)
    ok = all(b in curve.seconds and len(curve.seconds[b]) >= length for b in range(1, batch + 1))
    return curve if ok else None


def measured_curve(target_model, model: str, fingerprint: str, batch: int, length: int, log=None) -> CostCurve:
    """The kept curve, or one measured now for batches 1..`batch` (at most 8: larger batches scale the cost of
    8 rows) and 1..`length` tokens per row (a few seconds, once per model, machine and size) and kept."""
    batch = min(batch, MEASURED_BATCHES)
    curve = stored_curve(model, fingerprint, batch, length)
    if curve is not None:
        return curve
    if log:
        log(f"measuring the cost of batched target calls (batches 1-{batch}, 1-{length} tokens per row), once "
            f"for this model on this machine: {curve_file(model, fingerprint)}")
    curve = CostCurve.measure(target_model, list(range(1, batch + 1)), length, repeats=3)
    curve.meta = {"model": model, "machine": fingerprint}
    try:
        curve.save(curve_file(model, fingerprint))
    except OSError:
        pass  # a read-only cache: the curve serves this run only
    return curve
