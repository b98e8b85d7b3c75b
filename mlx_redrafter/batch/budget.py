"""How many tokens each row of a batched step verifies: the candidate length that maximises the tokens the
batch is expected to decide per second of target call.

On a CPU (and a GPU at small batches) a forward over B rows of P tokens costs little more than over B rows of 1
until B x P reaches the point where the products stop being bound by reading the weights; past it the cost grows
with every token. Speculation spends that flat part: a row whose drafts are often accepted gains from a longer
candidate, a batch of rows whose drafts are rejected loses. `CostCurve` is that cost, measured on this machine for
this model (`stored_curve` / `measured_curve`: measured once, at the first batched run, and kept beside the tuned
settings unless the machine was busy meanwhile; `python -m bench curve` measures and plots it); `Budget` reads it
with the recent acceptance of the kind of draft each row makes this step (a context copy, by the length of its
match, or the drafter's) and picks, every step, each row's candidate length (1 for every row = a plain batched
step: speculation backs off).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from mlx_redrafter.environment import named
from mlx_redrafter.files import read_json, write_atomic


@dataclass
class CostCurve:
    """Seconds of one batched target call, per batch size B, for P = 1, 2, ... tokens per row."""

    seconds: dict[int, list[float]]
    context: int = 0  # committed tokens per row when measured
    meta: dict = field(default_factory=dict)

    def cost(self, rows: int, tokens: float) -> float:
        """Seconds for `rows` rows of `tokens` tokens each (a fraction: rows of different lengths, `tokens` their
        mean): the nearest measured batch size (the next larger one scaled when `rows` is beyond the curve), linear
        between measured lengths and past the last."""
        sizes = sorted(self.seconds)
        b = min((s for s in sizes if s >= rows), default=sizes[-1])
        curve = self.seconds[b]
        scale = rows / b if rows > b else 1.0
        slope = curve[-1] - curve[-2] if len(curve) > 1 else curve[-1]

        def at(p: int) -> float:
            return curve[p - 1] if p <= len(curve) else curve[-1] + slope * (p - len(curve))

        lo = max(int(tokens), 1)
        frac = max(tokens - lo, 0.0)
        return (at(lo) + frac * (at(lo + 1) - at(lo))) * scale

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
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
        for r in range(repeats + 1):
            for b, p in cells:
                t = forward_s(b, p)
                if r:
                    times[(b, p)].append(t)
            if progress:
                progress(r, repeats)
        spread = statistics.median((max(v) - min(v)) / statistics.median(v) for v in times.values())
        return cls({b: [statistics.median(times[(b, p)]) for p in range(1, max_tokens + 1)] for b in batches},
                   context, {"spread": round(spread, 4), "load": round(load, 2), "cores": os.cpu_count() or 1})

    def unsteady(self) -> str | None:
        """Why this curve does not look measured on a quiet machine, or None: a longer candidate measured cheaper
        than a shorter one at the same batch size (beyond `STEADY_DIP`), repeats of a cell further apart than
        `STEADY_SPREAD` of their median (the median over the cells), or other work keeping more than half the cores
        busy when the measurement began. Such a curve prices candidates by what the other work did, so it serves
        the run that measured it and is not kept."""
        for b, v in sorted(self.seconds.items()):
            for p in range(1, len(v)):
                if v[p] < STEADY_DIP * max(v[:p]):
                    return f"{p + 1} tokens per row cost less than {p} at batch {b}"
        spread = self.meta.get("spread")
        if spread is not None and spread > STEADY_SPREAD:
            return f"repeated forwards {spread:.0%} apart"
        load, cores = self.meta.get("load"), self.meta.get("cores")
        if load is not None and cores and load > cores / 2:
            return f"load {load:.1f} on {cores} cores"
        return None

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

    A row's drafts are modelled as accepted one after another with probability alpha, so the k-th drafted token
    of a candidate is accepted with probability alpha**k. Alpha is kept per kind of draft, over every row (an
    exponential moving average over the drafts verified, each weighing `acceptance_decay`): the kind is what a row
    drafts from this step (`draft.base.drafting_kind`: a copy from its context, by the length of the match it
    copies after, or the drafter), known before the step is priced because copies are looked up first. The rows of
    a batch draft from the same sources, and one row's last few drafts are too few to price a step by (an alpha per
    row let a few rejected drafts send the batch to plain steps, where only rare probes correct it).

    Without a curve every drafting row gets the full `length`. With one, the rows' lengths that maximise the batch's
    expected tokens per second: drafted tokens are added in order of their chance of acceptance (the rows of one
    kind together, so a shared drafter drafts them in one call), and the step keeps the prefix of that order with
    the best rate. A step's cost is priced by the tokens it verifies in all (rows of different lengths run ragged:
    a row that copies 8 tokens beside three plain rows costs 11 tokens, not 32). Costs are measured in this run,
    relative to plain steps: `ratio(rows, tokens)` is what a step of that many tokens cost over the plain step run
    right before or after it (the median of the last `RATIO_WINDOW` such neighbours: one step slowed by something
    else, such as the cache growing, must not keep the batch from speculating until the next probes wash it out),
    and `plain[rows]` what a plain step costs now (every step updates it, a speculative one through its ratio).
    Neighbouring steps see the same contexts, so a ratio stays valid as the contexts grow, where an absolute time
    measured many steps ago would not; drafting, packing and acceptance, which the curve does not hold, are in it. A
    step size without a measured ratio takes the curve's ratio to the nearest measured one. The first step at a
    batch size is plain (the reference). With `measured` false (REDRAFTER_STEP_COSTS=curve) steps are priced by the
    curve alone: the choices then depend only on what the rows accepted, so the same requests take the same steps
    however busy the machine is, at the price of not seeing what the curve does not hold. A step tries the other
    kind of step (every drafting row at 2 tokens while backed off, a plain step otherwise) when there has been none
    for a while, so the acceptance and the costs stay current: `probe` steps at first, twice as long after each
    probe (at most `max_probe`), back to `probe` when the choice changes while the rows draft from the same kinds (a
    change of mind, not of situation).
    """

    def __init__(self, length: int, curve: CostCurve | None = None, decay: float = 0.8, prior: float = 0.5,
                 probe: int = 12, max_probe: int = 96, acceptance_decay: float = 0.95, measured: bool | None = None):
        self.length, self.curve, self.decay, self.prior = length, curve, decay, prior
        self.measured = measures_steps() if measured is None else measured
        self.acceptance_decay = acceptance_decay
        self.probe, self.max_probe = probe, max_probe
        self.alpha: dict[str, float] = {}  # kind of draft -> acceptance, over every row
        self.caps: list[int] = []  # each row's longest candidate
        self.copy_caps: list[int] = []  # each row's longest copy (a copy that keeps being accepted grows)
        self.step_caps: list[int] = []  # each row's longest candidate at the last step (copies may be longer)
        self.plain: dict[int, float] = {}  # rows -> seconds of a plain step now (moving average)
        self.ratios: dict[tuple[int, int], deque[float]] = {}  # (rows, tokens > rows) -> its last pairs' ratios
        self.previous: tuple[int, int, float] | None = None  # (rows, tokens, seconds) of the last observed step
        self.steps = 0
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

    def join(self, cap: int | None = None, copy_cap: int | None = None) -> None:
        """A row joins; its candidates are at most `cap` tokens (default: `length`), a copy (the only candidates of
        a row in a step) at most `copy_cap` (default: `cap`; its sources' longest, `Allocator.longest`)."""
        c = min(cap or self.length, self.length)
        self.caps.append(c)
        self.copy_caps.append(max(copy_cap or c, c))

    def select(self, keep: list[int]) -> None:
        self.caps = [self.caps[i] for i in keep]
        self.copy_caps = [self.copy_caps[i] for i in keep]

    def acceptance(self, kind: str) -> float:
        """Alpha of this kind of draft (its prior, `PRIORS` or `prior`, until a row has drafted so)."""
        return self.alpha.get(kind, PRIORS.get(kind, self.prior))

    def ratio(self, rows: int, tokens: int) -> float:
        """A measured step of `tokens` verified tokens over a neighbouring plain step: the median of its last pairs."""
        return statistics.median(self.ratios[rows, tokens])

    def cost(self, rows: int, tokens: int) -> float:
        """Expected seconds of a step of `rows` rows verifying `tokens` tokens in all (plain steps of this many rows
        must have been measured, unless priced by the curve alone)."""
        if not self.measured:
            return self.curve.cost(rows, max(tokens, rows) / rows)
        base = self.plain[rows]
        if tokens <= rows:
            return base
        measured = [n for r, n in self.ratios if r == rows]
        if not measured:
            return base * self.curve.cost(rows, tokens / rows) / self.curve.cost(rows, 1)
        nearest = min(measured, key=lambda n: (abs(n - tokens), n))
        return (base * self.ratio(rows, nearest) * self.curve.cost(rows, tokens / rows)
                / self.curve.cost(rows, nearest / rows))

    def lengths(self, kinds: list[str | None], fixed: list[bool] | None = None,
                offered: list[int | None] | None = None) -> list[int]:
        """The candidate length of each row this step, given what each drafts from (None: nothing; it gets 1) and,
        for a row whose only candidates are copies, the longest one (`offered`, tokens with g0; None otherwise): a
        row may take a copy of up to its copy cap (`join`; a copy that keeps being accepted grows), a shorter copy
        prices the row by its own length. `fixed` rows always get their cap: a sampling row whose
        drafts must not depend on the other rows (its seeded output depends on what it drafts, not only on the
        target), while greedy rows' output never does."""
        offered = offered or [None] * len(kinds)
        self.step_caps = [c if o is None else min(o, cc) for c, cc, o in zip(self.caps, self.copy_caps, offered)]
        self.kinds = list(kinds)
        chosen = self._choose(kinds)
        if max(chosen, default=1) > 1:
            self.last_speculative = self.steps
        else:
            self.last_plain = self.steps
        fixed = fixed or [False] * len(kinds)
        return [(c if f else n) if k is not None else 1 for c, n, k, f in zip(self.caps, chosen, kinds, fixed)]

    def _choose(self, kinds: list[str | None]) -> list[int]:
        self.steps += 1
        rows = len(kinds)
        plain = [1] * rows
        if all(k is None for k in kinds):
            return plain
        if self.curve is None:
            return [min(self.length, c) if k is not None else 1 for c, k in zip(self.step_caps, kinds)]
        if self.measured and rows not in self.plain:
            return plain  # the reference: plain steps at this batch size, measured first
        best = self._best(kinds)
        speculative = max(best) > 1
        if speculative != self.speculating and kinds == self.situation:  # a change of mind: probe soon again
            self.interval = self.probe
        self.speculating, self.situation = speculative, list(kinds)
        since = self.steps - (self.last_plain if speculative else self.last_speculative)
        # try the other kind now and then, so the measurements stay current (by the curve alone, only the acceptance
        # of drafts can change: a plain step would tell nothing)
        if since >= self.interval and (self.measured or not speculative):
            self.interval = min(2 * self.interval, self.max_probe)
            return plain if speculative else [min(2, c) if k is not None else 1 for c, k in zip(self.step_caps, kinds)]
        return best

    def _best(self, kinds: list[str | None]) -> list[int]:
        """Each row's length at the best expected rate (see the class docstring)."""
        rows = len(kinds)
        groups: dict[str, list[int]] = {}
        for r, k in enumerate(kinds):
            if k is not None and self.step_caps[r] > 1:
                groups.setdefault(k, []).append(r)
        adds = []  # (chance of acceptance of each token, the rows that add one more token)
        for kind, members in groups.items():
            alpha = self.acceptance(kind)
            for level in range(1, max(self.step_caps[r] for r in members)):
                adds.append((alpha**level, [r for r in members if self.step_caps[r] > level]))
        adds.sort(key=lambda a: -a[0])  # stable: one kind's tokens stay in order
        lengths, best = [1] * rows, [1] * rows
        gain = tokens = rows
        best_rate = rows / self.cost(rows, rows)
        for chance, members in adds:
            gain += chance * len(members)
            tokens += len(members)
            for r in members:
                lengths[r] += 1
            rate = gain / self.cost(rows, tokens)
            if rate > best_rate:
                best_rate, best = rate, list(lengths)
        return best

    def observe(self, lengths: list[int], accepted: list[int], seconds: float | None = None) -> None:
        """What the step's rows accepted (drafts) with the lengths they verified, and what the step cost."""
        for r, (n, a) in enumerate(zip(lengths, accepted)):
            kind = self.kinds[r]
            if n <= 1 or kind is None:
                continue
            n = min(n, self.step_caps[r])  # a shorter copy had no more drafts
            trials = a + (a < n - 1)  # accepted drafts, then the rejected one (if the run ended early)
            if trials:
                keep = self.acceptance_decay**trials
                self.alpha[kind] = keep * self.acceptance(kind) + (1 - keep) * a / trials
        rows = len(lengths)
        tokens = sum(min(n, c) if k is not None else 1 for n, c, k in zip(lengths, self.step_caps, self.kinds))
        if seconds is None or self.curve is None or not self.measured or not rows or seconds <= 0:
            return
        before, self.previous = self.previous, (rows, tokens, seconds)
        if before is not None and before[0] == rows and (before[1] == rows) != (tokens == rows):
            # a plain step beside a speculative one: the ratio of their costs, by the speculative step's size
            size, ratio = (tokens, seconds / before[2]) if tokens > rows else (before[1], before[2] / seconds)
            self.ratios.setdefault((rows, size), deque(maxlen=RATIO_WINDOW)).append(ratio)
        if tokens == rows:
            self.plain[rows] = self._average(self.plain.get(rows), seconds)
        elif rows in self.plain:
            self.plain[rows] = self._average(self.plain[rows], seconds * self.plain[rows] / self.cost(rows, tokens))

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else self.decay * old + (1 - self.decay) * new


def measures_steps() -> bool:
    """Whether batched steps are priced by this run's timings as well as the cost curve (REDRAFTER_STEP_COSTS=
    measured, the default) or by the curve alone (=curve: reproducible step choices); UserError for another value."""
    return named("REDRAFTER_STEP_COSTS") != "curve"


MEASURED_BATCHES = 8  # the largest batch a curve measures; larger ones scale its cost
RATIO_WINDOW = 5  # plain / speculative pairs behind each measured cost ratio (their median)
# Acceptance assumed for a kind of draft before any row has drafted so, where it is known to differ from `prior`
# (kinds: `LookupSource.kind`, the source's name and the length of the match it copied after, at most 4). A copy of
# the request's predicted output while the answer follows it is the answer the caller expects, so the first request
# with a prediction copies long from its first steps (at 0.5 the server test's 64-token answer took 12 target calls;
# now 7, and 5 once the budget has seen predictions). Context copies after 3- and 4-token matches: their acceptance
# at the end of 32 held-out prompts decoded in batches of 4 (bench/results/cpu-avx512/priors-20261130/: lookup2
# 0.55, lookup3 0.79, lookup4 0.81, the drafter 0.53).
PRIORS = {"prediction4": 0.9, "lookup4": 0.8, "lookup3": 0.75}
STEADY_DIP = 0.85  # a longer candidate measured below this share of a shorter one's cost: the machine was busy
STEADY_SPREAD = 0.25  # repeats of a cell this far apart (share of their median): the machine was busy
CURVE_VERSION = 2  # bumped when the target forward's cost changes shape, so that kept curves are measured again


def curve_file(model: str, fingerprint: str) -> Path:
    """Where the measured curve of a model on this machine is kept (beside the tuned settings)."""
    from mlx_redrafter.tuning import tuned_file

    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in f"{model}-{fingerprint}")
    return tuned_file().parent / f"cost-curve-{safe}-v{CURVE_VERSION}.json"


def stored_curve(model: str, fingerprint: str, batch: int, length: int) -> CostCurve | None:
    """The kept curve if it covers batches up to `batch` and `length` tokens per row and looks measured on a quiet
    machine (`CostCurve.unsteady`: one kept by an earlier version may not), else None."""
    path = curve_file(model, fingerprint)
    if not path.exists():
        return None
    curve = CostCurve.load(path)
    ok = all(b in curve.seconds and len(curve.seconds[b]) >= length for b in range(1, batch + 1))
    return curve if ok and curve.unsteady() is None else None


def measured_curve(target_model, model: str, fingerprint: str, batch: int, length: int, log=None) -> CostCurve:
    """The kept curve, or one measured now for batches 1..`batch` (at most 8: larger batches scale the cost of
    8 rows) and 1..`length` tokens per row (a few seconds, once per model, machine and size) and kept unless the
    machine was busy while it was measured (then it serves this run, and the next run measures again)."""
    batch = min(batch, MEASURED_BATCHES)
    curve = stored_curve(model, fingerprint, batch, length)
    if curve is not None:
        return curve
    if log:
        log(f"measuring the cost of batched target calls (batches 1-{batch}, 1-{length} tokens per row), once "
            f"for this model on this machine: {curve_file(model, fingerprint)}")
    curve = CostCurve.measure(target_model, list(range(1, batch + 1)), length, repeats=3)
    curve.meta.update(model=model, machine=fingerprint)
    why = curve.unsteady()
    if why is not None:
        if log:
            log(f"the machine was busy while the cost of batched calls was measured ({why}): the measurement "
                f"serves this run only, and the next run measures again")
        return curve
    try:
        curve.save(curve_file(model, fingerprint))
    except OSError:
        pass  # a read-only cache: the curve serves this run only
    return curve
