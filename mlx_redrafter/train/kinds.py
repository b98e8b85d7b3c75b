"""The drafter kinds the trainer builds, and a fresh Medusa or semi-AR drafter for a target.

    redrafter            ReDrafter (train/loop.py new_drafter)
    medusa               Medusa-1: one head per draft step (T = draft_len heads), num_draft_layers ResBlocks each
    semi_ar_transformer  semi-AR drafter, simplified-transformer TLM (D = H/2), exit_dim E, num_draft_layers
    semi_ar_lstm         semi-AR drafter, 2-layer LSTM TLM (D = H/2), exit_dim E, num_draft_layers

All kinds share the training data, loss, draft vocabulary (draft_vocab_size most frequent tokens) and budget.
With init_from_target the vocabulary projections start as the target's own output rows of those tokens and the
ResBlocks as identities (Medusa's init; for the semi-AR head in_proj = [I 0] as the ReDrafter's when E = H).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from mlx_redrafter.draft import medusa, semi_ar
from mlx_redrafter.draft.medusa import MedusaArgs, MedusaHeads
from mlx_redrafter.draft.semi_ar import SemiARArgs, SemiARDrafter
from mlx_redrafter.errors import UserError
from mlx_redrafter.models.loader import Target

KINDS = ("redrafter", "medusa", "semi_ar_transformer", "semi_ar_lstm")
KIND_TITLES = {"redrafter": "ReDrafter", "medusa": "Medusa", "semi_ar_transformer": "Semi-AR (simplified transformer)",
               "semi_ar_lstm": "Semi-AR (LSTM)"}


# the decode mode (`--draft`) that drafts with a drafter of each kind
DRAFT_MODE = {"redrafter": "rnn", "medusa": "medusa", "semi_ar_transformer": "semi_ar", "semi_ar_lstm": "semi_ar"}


def check_kind(kind: str) -> None:
    """One-line error unless `kind` is a drafter kind the trainer builds."""
    if kind not in KINDS:
        raise UserError(f"--kind must be one of {', '.join(KINDS)} (got {kind!r})")


def kind_of(drafter: Any) -> str:
    """The trainer kind of a drafter object (for resuming a run of the same kind)."""
    return kind_of_config({"model_type": drafter.args.model_type, "tlm": getattr(drafter.args, "tlm", None)})


def kind_of_config(cfg: dict) -> str:
    """The trainer kind of a drafter config (its config.json as a dict)."""
    model_type = cfg.get("model_type")
    if model_type == medusa.MODEL_TYPE:
        return "medusa"
    if model_type == semi_ar.MODEL_TYPE:
        return f"semi_ar_{cfg.get('tlm', 'transformer')}"
    return "redrafter"


def new_head_drafter(target: Target, cfg: Any, draft_vocab: np.ndarray) -> MedusaHeads | SemiARDrafter:
    """A fresh Medusa or semi-AR drafter of `cfg.kind` (a TrainConfig) for `target`, float32."""
    margs = target.model.args
    H, V = margs.hidden_size, margs.vocab_size
    mx.random.seed(cfg.seed)
    if cfg.kind == "medusa":
        d = MedusaHeads(MedusaArgs(vocab_size=V, hidden_size=H, medusa_num_heads=cfg.draft_len,
                                   medusa_num_layers=cfg.num_draft_layers, draft_vocab_size=len(draft_vocab)))
        projections = [head[-1] for head in d.medusa_head]
        blocks = [blk for head in d.medusa_head for blk in head[:-1]]
    elif cfg.kind in ("semi_ar_transformer", "semi_ar_lstm"):
        d = SemiARDrafter(SemiARArgs(vocab_size=V, hidden_size=H, tlm=cfg.kind.removeprefix("semi_ar_"),
                                     tlm_dim=H // 2, exit_dim=cfg.exit_dim, num_layers=cfg.num_draft_layers,
                                     max_draft_len=max(cfg.draft_len, 1), draft_vocab_size=len(draft_vocab)))
        projections, blocks = [d.lm_head[-1]], d.lm_head[:-1]
        if cfg.init_from_target and cfg.exit_dim == H:
            d.in_proj.weight = mx.concatenate([mx.eye(H), mx.zeros((H, H // 2))], axis=1)
            d.in_proj.bias = mx.zeros((H,))
    else:
        check_kind(cfg.kind)
        raise UserError(f"kind {cfg.kind!r} is built by train.loop.new_drafter")
    d.draft_vocab = mx.array(draft_vocab, dtype=mx.int32)
    if cfg.init_from_target and (cfg.kind == "medusa" or cfg.exit_dim == H):
        rows = target.model.output_weight()[d.draft_vocab].astype(mx.float32)
        for proj in projections:
            proj.weight = rows
        for blk in blocks:
            blk.linear.weight = mx.zeros_like(blk.linear.weight)
            blk.linear.bias = mx.zeros_like(blk.linear.bias)
    d.set_dtype(mx.float32)
    d.draft_vocab = d.draft_vocab.astype(mx.int32)
    mx.eval(d.parameters())
    return d
