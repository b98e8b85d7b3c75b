"""What the package ships per model: its drafter and its answer table (mlx_redrafter/drafters/<name>/)."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from mlx_redrafter.draft.lookup import AnswerTable
from mlx_redrafter.models.registry import get

if TYPE_CHECKING:
    from mlx_redrafter.models.loader import Target

SHIPPED_DRAFTERS = Path(__file__).parent / "drafters"


def shipped_folder(model_name: str) -> Path:
    """Where the package ships a model's drafter and answer table (its registry entry's drafter, else its name)."""
    entry = get(model_name)
    return SHIPPED_DRAFTERS / (entry.drafter if entry is not None and entry.drafter else model_name)


def shipped_drafter_path(model_name: str) -> Path | None:
    """The drafter shipped in the package for a model, or None."""
    p = shipped_folder(model_name)
    return p if (p / "config.json").exists() else None


def answer_table_path(target: Target) -> Path:
    """Where the answer table shipped for this model is (answers.npz beside its drafter), if it is."""
    return shipped_folder(target.name) / "answers.npz"


def answer_table(target: Target) -> AnswerTable | None:
    """The answer table shipped for this model, or None."""
    path = answer_table_path(target)
    return _load_answer_table(path, target.model.args.vocab_size) if path.exists() else None


@cache
def _load_answer_table(path: Path, vocab_size: int) -> AnswerTable:
    return AnswerTable.load(path, vocab_size)
