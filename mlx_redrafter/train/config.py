"""The drafter training settings (`TrainConfig`) and what each may hold, apart from the loop so that the command
line reads its defaults without importing MLX."""

from __future__ import annotations

from dataclasses import dataclass

from mlx_redrafter.errors import UserError
from mlx_redrafter.schema import MAX_DRAFT_LAYERS, MAX_VOCAB, MAX_WIDTH, Field, check_option


@dataclass
class TrainConfig:
    """Drafter shape and optimisation settings. The defaults are a recipe that trains here in about half an hour
    (`make train`); the shipped drafter's own settings are in its model card."""

    exit_dim: int = 576
    num_draft_layers: int = 2
    draft_vocab_size: int = 8192
    draft_len: int = 5  # T: draft steps trained per context position
    labels: str = "hard"  # hard: the target's top-1 token; soft: its top-k distribution (within the head)
    steps: int = 1000
    batch_size: int = 256  # context positions per step (x T predictions)
    lr: float = 1e-3
    min_lr_ratio: float = 0.05
    warmup: int = 100
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    input_dropout: float = 0.0  # training-only dropout on h and the token embeddings
    feature_noise: float = 0.0  # training-only uniform noise U(-a, a) added to h (EAGLE uses 0.1)
    freeze_head: bool = False  # keep the vocabulary projection at the target's own output rows (init_from_target)
    head_only: bool = False  # train the vocabulary projection alone, the rest as init_from left it
    init_from_target: bool = True  # head = the target's (tied) output rows, input_proj = [I 0]
    eval_every: int = 500
    checkpoint_every: int = 500
    seed: int = 0
    kind: str = "redrafter"  # redrafter | medusa | semi_ar_transformer | semi_ar_lstm (see train/kinds.py)
    sources: tuple[str, ...] = ("greedy",)  # corpora trained on by default (cmd/train.py corpus_dir)
    init_from: str | None = None  # start from this drafter's weights (same shape), e.g. a first training stage
    feature_layers: tuple[int, ...] = ()  # target layers fused into the context besides the last (EAGLE-3 style)
    head_rows: int | None = None  # with init_from: grow its head to this many rows (draft/head_rows.py)

    def check(self) -> TrainConfig:
        """Itself, or a one-line UserError naming the first setting out of range (by its `redrafter-mlx train`
        option where it has one); for before any work."""
        for name, option, field in CONFIG_FIELDS:
            if getattr(self, name) is None and name not in ("init_from", "head_rows"):
                raise UserError(f"{option} must be {field.expected()} (got None)")
            check_option(option, getattr(self, name), field)
        from mlx_redrafter.draft.redrafter import check_feature_layers
        from mlx_redrafter.train.kinds import check_kind

        check_kind(self.kind)
        if self.feature_layers:
            check_feature_layers(list(self.feature_layers), "--feature-layers")
            if self.kind != "redrafter":
                raise UserError(f"--feature-layers is for the recurrent drafter (--kind redrafter), not {self.kind}")
        if self.head_rows is not None and (self.init_from is None or self.kind != "redrafter"):
            raise UserError("--head-rows grows the head of a recurrent drafter given by --init-from: pass one (a "
                            "fresh drafter's head has --draft-vocab rows)")
        if self.head_only and (self.init_from is None or self.kind != "redrafter" or self.freeze_head):
            raise UserError("--head-only trains the head of a recurrent drafter given by --init-from and nothing "
                            "else: pass --init-from, and leave out --freeze-head")
        return self


# (TrainConfig attribute, its `train` option (or the attribute's name), what it may hold)
CONFIG_FIELDS: tuple[tuple[str, str, Field], ...] = (
    ("exit_dim", "--exit-dim", Field("", int, 1, MAX_WIDTH)),
    ("num_draft_layers", "--layers", Field("", int, 0, MAX_DRAFT_LAYERS)),
    ("draft_vocab_size", "--draft-vocab", Field("", int, 1, MAX_VOCAB)),
    ("draft_len", "--draft-len", Field("", int, 1, 64)),
    ("labels", "--labels", Field("", str, choices=("hard", "soft"))),
    ("steps", "--steps", Field("", int, 1, 10**9)),
    ("batch_size", "--batch", Field("", int, 1, 1 << 20)),
    ("lr", "--lr", Field("", float, hi=10.0, positive=True)),
    ("min_lr_ratio", "min_lr_ratio", Field("", float, 0, 1)),
    ("warmup", "warmup", Field("", int, 0, 10**9)),
    ("weight_decay", "--weight-decay", Field("", float, 0, 1)),
    ("grad_clip", "grad_clip", Field("", float, positive=True)),
    ("input_dropout", "--dropout", Field("", float, 0, 0.9)),
    ("feature_noise", "--noise", Field("", float, 0, 100)),
    ("freeze_head", "--freeze-head", Field("", bool)),
    ("head_only", "--head-only", Field("", bool)),
    ("init_from_target", "init_from_target", Field("", bool)),
    ("eval_every", "eval_every", Field("", int, 1, 10**9)),
    ("checkpoint_every", "checkpoint_every", Field("", int, 1, 10**9)),
    ("seed", "--seed", Field("", int, 0, 2**32 - 1)),
    ("kind", "--kind", Field("", str)),
    ("init_from", "init_from", Field("", str)),
    ("head_rows", "--head-rows", Field("", int, 1, MAX_VOCAB)),
)
