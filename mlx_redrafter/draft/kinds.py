"""Drafter kinds: which class a checkpoint holds (its config's `model_type`), and which draft mode uses it.

    rnn      ReDrafter (drafter.py)          model_type "recurrent_drafting_drafter" (or none: Apple's format)
    medusa   Medusa-1 heads (medusa.py)      model_type "medusa"
    semi_ar  semi-AR drafter (semi_ar.py)    model_type "semi_ar_drafter"
"""

from __future__ import annotations

from pathlib import Path
from typing import Union

import mlx.core as mx

from mlx_redrafter.draft import medusa, semi_ar
from mlx_redrafter.draft.medusa import MedusaHeads
from mlx_redrafter.draft.redrafter import MODEL_TYPE as REDRAFTER_TYPE
from mlx_redrafter.draft.redrafter import Drafter, DrafterArgs, load_drafter, read_checkpoint
from mlx_redrafter.draft.semi_ar import SemiARDrafter
from mlx_redrafter.errors import UserError
from mlx_redrafter.files import read_json
from mlx_redrafter.models import safetensors_header

AnyDrafter = Union[Drafter, MedusaHeads, SemiARDrafter]
LOADERS = {REDRAFTER_TYPE: load_drafter, medusa.MODEL_TYPE: medusa.load_medusa,
           semi_ar.MODEL_TYPE: semi_ar.load_semi_ar}
ARGS_OF_TYPE = {REDRAFTER_TYPE: DrafterArgs, medusa.MODEL_TYPE: medusa.MedusaArgs,
                semi_ar.MODEL_TYPE: semi_ar.SemiARArgs}
MODE_OF_TYPE = {REDRAFTER_TYPE: "rnn", medusa.MODEL_TYPE: "medusa", semi_ar.MODEL_TYPE: "semi_ar"}


def load_any_drafter(path: str | Path, dtype: mx.Dtype | None = mx.float32) -> AnyDrafter:
    """Load a drafter directory of any kind, dispatching on its config's model_type; one-line errors."""
    cfg, weights_file = read_checkpoint(path)
    return LOADERS[model_type_of(cfg, weights_file.parent / "config.json")](path, dtype)


def model_type_of(cfg: dict, cfg_file: Path) -> str:
    """The known drafter kind a config names (none named: ReDrafter); one-line UserError otherwise."""
    model_type = cfg.get("model_type", REDRAFTER_TYPE)
    if "medusa_num_heads" in cfg and model_type != medusa.MODEL_TYPE:
        raise UserError(f"{cfg_file.parent} is a Medusa checkpoint in the FasterDecoding layout: convert it with "
                        f"`python -m convert.from_torch {cfg_file.parent}`")
    if model_type not in LOADERS:
        raise UserError(f"{cfg_file}: unknown drafter model_type {model_type!r} (known: {', '.join(LOADERS)})")
    return model_type


def check_drafter_config(folder: Path) -> None:
    """One-line UserError unless `folder`/config.json is a valid drafter config of a known kind."""
    cfg_file = folder / "config.json"
    if not cfg_file.exists():
        raise UserError(f"{folder} has no config.json")
    _check_config(read_json(cfg_file, "drafter config"), cfg_file)


def check_drafter_files(path: str | Path) -> None:
    """One-line UserError unless the drafter at `path` has a valid config of a known kind and a weights file whose
    layout parses: what can be checked without a target, so a malformed drafter fails before the target loads."""
    cfg, weights_file = read_checkpoint(path)
    _check_config(cfg, weights_file.parent / "config.json")
    safetensors_header.read_header(weights_file, "drafter weights")


def _check_config(cfg: dict, cfg_file: Path) -> None:
    ARGS_OF_TYPE[model_type_of(cfg, cfg_file)].from_dict(cfg, f"drafter config {cfg_file}")


def draft_kind(drafter: AnyDrafter | None) -> str | None:
    """The draft mode a drafter serves: 'rnn', 'medusa', 'semi_ar' (None: no drafter)."""
    if drafter is None:
        return None
    return MODE_OF_TYPE[drafter.args.model_type]
