"""Settings read from environment variables. A value that is set but malformed is the user's error (one line that
names the variable and what it takes), never a silent default."""

from __future__ import annotations

import math
import os

from mlx_redrafter.errors import UserError


def switch(var: str, allowed: tuple[str, ...]) -> str:
    """The lower-cased value of switch `var` ('auto' when unset), one of `allowed`."""
    value = os.environ.get(var, "auto").strip().lower()
    if value not in allowed:
        raise UserError(f"{var}={os.environ[var]!r} is not a known value; use one of: {', '.join(allowed)}")
    return value


# Switches read where they act, named here with their values so that `check_named` can check them all before
# anything loads (the command line's and the benchmarks' first step: a bad value is an error even for --help).
NAMED = {
    "REDRAFTER_STEP_COSTS": ("auto", "measured", "curve"),  # batch/budget.py
    "REDRAFTER_DRAFT_WEIGHTS": ("auto", "int8", "float16", "float32"),  # draft/weight_copies.py
}


def named(var: str) -> str:
    """The value of the named switch `var` (`NAMED`): `switch(var, NAMED[var])`."""
    return switch(var, NAMED[var])


def check_named() -> None:
    """UserError for the first named switch set to an unknown value."""
    for var in NAMED:
        named(var)


def number(var: str, default: float, minimum: float, integer: bool = False) -> float:
    """The number in `var` (`default` when unset or empty): finite, at least `minimum`, whole where `integer`."""
    raw = os.environ.get(var, "").strip()
    if not raw:
        return default
    what = "a whole number" if integer else "a number"
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or value < minimum:
        raise UserError(f"{var}={os.environ[var]!r} is not valid; set it to {what} >= {minimum:g}, or unset it")
    return value
