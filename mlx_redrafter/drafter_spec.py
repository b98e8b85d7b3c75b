"""Drafter specs as users give them (--drafter): 'default', 'none', 'random:SEED[:EXIT_DIM]' or a path.

A leaf module: loading (api.py) and tuned-settings keys (tuning.py) both parse specs here.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlx_redrafter.errors import UserError


@dataclass
class DrafterSpec:
    """A parsed --drafter value: 'default', 'none', 'random:SEED[:EXIT_DIM]' or a path."""

    kind: str  # default | none | random | path
    seed: int = 0
    exit_dim: int | None = None
    path: str = ""


def parse_drafter_spec(spec: str | None) -> DrafterSpec:
    """The one parser of drafter specs (used by loading and by tuned-settings keys)."""
    if spec in (None, "", "none"):
        return DrafterSpec("none")
    if spec == "default":
        return DrafterSpec("default")
    if spec.startswith("random"):
        parts = spec.split(":")
        try:
            d = DrafterSpec("random", seed=int(parts[1]) if len(parts) > 1 else 0,
                            exit_dim=int(parts[2]) if len(parts) > 2 else None)
        except ValueError:
            d = None
        if d is None or len(parts) > 3 or not 0 <= d.seed < 1 << 63:
            raise UserError(f"bad drafter spec {spec!r}: use random:SEED or random:SEED:EXIT_DIM (integers, "
                            f"SEED >= 0)")
        return d
    return DrafterSpec("path", path=spec)
