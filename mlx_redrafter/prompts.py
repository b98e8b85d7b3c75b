"""Prompts files: JSON Lines with a "prompt" string per line (MT-bench rows: the first of their "turns")."""

from __future__ import annotations

import json
from pathlib import Path

from mlx_redrafter.errors import UserError
from mlx_redrafter.files import read_text


def read_prompts(path: str | Path) -> list[dict]:
    """Rows of a JSONL prompts file, each with a non-empty "prompt" (other fields kept); one-line UserError if bad."""
    p = Path(path)
    rows = []
    for i, line in enumerate(read_text(p, "prompts file").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            raise UserError(f"{p}:{i} is not valid JSON (expected {{\"prompt\": ...}} per line)") from None
        if isinstance(obj, dict) and "prompt" not in obj and isinstance(obj.get("turns"), list) and obj["turns"]:
            obj = {**obj, "prompt": obj["turns"][0]}
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"].strip():
            raise UserError(f"{p}:{i} has no non-empty \"prompt\" string")
        rows.append(obj)
    if not rows:
        raise UserError(f"prompts file {p} has no prompts")
    return rows


PACKAGED = Path(__file__).parent / "data"


def packaged(name: str = "mt_bench.jsonl") -> Path:
    """A prompts file shipped inside the package (mlx_redrafter/data/), e.g. the MT-bench questions."""
    return PACKAGED / name


def first_turns(path: str | Path | None = None, num: int | None = None, spread: bool = False) -> list[dict]:
    """Rows of a prompts file (default: MT-bench) with their "prompt"; `num` of them, the first ones or,
    with `spread`, evenly spread over the file (MT-bench is grouped by category)."""
    rows = read_prompts(path or packaged())
    if num is not None:
        if num < 1:
            raise UserError(f"the number of prompts must be >= 1 (got {num})")
        if spread and num < len(rows):
            rows = [rows[(k * len(rows)) // num] for k in range(num)]
        else:
            rows = rows[:num]
    return rows
