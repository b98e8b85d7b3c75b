"""Prompts files: JSON Lines with a "prompt" string per line (MT-bench rows: the first of their "turns")."""

from __future__ import annotations

import json
from pathlib import Path

from .errors import UserError


def read_prompts(path: str | Path) -> list[dict]:
    """Rows of a JSONL prompts file, each with a non-empty "prompt" (other fields kept); one-line UserError if bad."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"prompts file {p} does not exist")
    rows = []
    with p.open(encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                raise UserError(f"{p}:{i} is not valid JSON (expected {{\"prompt\": ...}} per line)") from None
            if isinstance(obj, dict) and "prompt" not in obj and isinstance(obj.get("turns"), list) and obj["turns"]:
                obj = {**obj, "prompt": obj["turns"][0]}
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"].strip():
                raise UserError(f"{p}:{i} has no non-empty \"prompt\" string")
            rows.append(obj)
    if not rows:
        raise UserError(f"prompts file {p} has no prompts")
    return rows
