"""What the Medusa and semi-autoregressive drafters share: their config, the draft vocabulary, random init, loading.

Both are heads over the frozen target's post-norm hidden state with a vocabulary projection over either the whole
vocabulary or K token ids (`draft_vocab_size` = K and a `draft_vocab` int32 tensor, as the ReDrafter format
extension). Their checkpoints are drafter directories like the ReDrafter's (config.json with a `model_type` of
their own + model.safetensors, written by `drafter.save_drafter`); quantization is not offered for them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn

from mlx_redrafter.draft.redrafter import cast_floats, check_draft_vocab_size, load_weights_into, read_checkpoint
from mlx_redrafter.errors import UserError
from mlx_redrafter.model import post_norm_state
from mlx_redrafter.schema import MAX_VOCAB, MAX_WIDTH, Field, check_fields, check_object


@dataclass(kw_only=True)
class HeadArgs:
    """Config keys every head drafter has; subclasses add theirs and name the required ones."""

    vocab_size: int
    hidden_size: int
    model_type: str
    draft_vocab_size: int | None = None  # head over a token subset (K rows)
    extra: dict[str, Any] = field(default_factory=dict)
    FIELDS: ClassVar[tuple[Field, ...]] = (
        Field("vocab_size", int, 1, MAX_VOCAB, required=True),
        Field("hidden_size", int, 1, MAX_WIDTH, required=True),
        Field("draft_vocab_size", int, 1, MAX_VOCAB),
        Field("model_type", str),
    )  # subclasses add theirs
    KIND: ClassVar[str] = "head drafter"  # for messages

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], where: str | None = None) -> HeadArgs:
        """Args from a config dict checked against `FIELDS` (types, ranges; `where` names it in messages);
        unknown keys are kept in `extra`; a one-line UserError for a bad config."""
        where = where or f"{cls.KIND} config.json"
        check_object(cfg, where)
        if cfg.get("quantization") is not None:
            raise UserError(f"quantized {cls.KIND}s are not supported ({where} has `quantization`)")
        check_fields(cfg, cls.FIELDS, where)
        check_draft_vocab_size(cfg, where)
        known = {f.name for f in fields(cls) if f.name != "extra"}
        return cls(**{k: v for k, v in cfg.items() if k in known and v is not None},
                   extra={k: v for k, v in cfg.items() if k not in known and k != "quantization"})

    def to_dict(self) -> dict[str, Any]:
        """The config.json contents (draft_vocab_size only when set)."""
        d = {k: v for k, v in asdict(self).items() if k != "extra"}
        if d["draft_vocab_size"] is None:
            del d["draft_vocab_size"]
        return {**self.extra, **d}

    @property
    def head_rows(self) -> int:
        """K: rows of the vocabulary projection."""
        return self.draft_vocab_size or self.vocab_size


class HeadDrafter(nn.Module):
    """Base of the Medusa and semi-AR drafters: `args`, optional `draft_vocab`, `token_ids`, `num_params`."""

    ARGS: ClassVar[type[HeadArgs]] = HeadArgs

    def __init__(self, args: HeadArgs):
        super().__init__()
        self.args = args
        if args.draft_vocab_size:
            self.draft_vocab = mx.arange(args.draft_vocab_size, dtype=mx.int32)

    def context(self, hidden: mx.array) -> mx.array:
        """What the heads condition on, from the target's features: the post-norm state (these drafters read the
        last layer alone, whatever layers a target paired with another drafter returns beside it)."""
        return post_norm_state(hidden, self.args.hidden_size)

    def token_ids(self, head_index: mx.array) -> mx.array:
        """Map head output indices to target token ids (identity for a full-vocab head)."""
        return self.draft_vocab[head_index] if self.args.draft_vocab_size else head_index

    def num_params(self) -> int:
        """Number of weights (the draft vocabulary's token ids not counted)."""
        from mlx.utils import tree_flatten

        return sum(v.size for k, v in tree_flatten(self.parameters()) if k != "draft_vocab")

    @classmethod
    def random(cls, args: HeadArgs, seed: int, dtype: mx.Dtype = mx.float32) -> HeadDrafter:
        """A randomly initialised drafter (for exactness tests and smoke runs); with a draft vocabulary its K token
        ids are random distinct ones."""
        mx.random.seed(seed)
        d = cls(args)
        if args.draft_vocab_size:
            d.draft_vocab = mx.sort(mx.random.permutation(args.vocab_size)[: args.draft_vocab_size]).astype(mx.int32)
        cast_floats(d, dtype)
        mx.eval(d.parameters())
        return d

    @classmethod
    def load(cls, path: str | Path, dtype: mx.Dtype | None = mx.float32) -> HeadDrafter:
        """Load a drafter directory of this kind (config.json + model.safetensors); floats cast to `dtype`."""
        cfg, weights_file = read_checkpoint(path)
        model_type = cls.ARGS.__dataclass_fields__["model_type"].default
        if cfg.get("model_type") != model_type:
            raise UserError(f"{weights_file.parent / 'config.json'} is a {cfg.get('model_type')!r} config, not a "
                            f"{cls.ARGS.KIND} ({model_type!r})")
        d = cls(cls.ARGS.from_dict(cfg, f"{cls.ARGS.KIND} config {weights_file.parent / 'config.json'}"))
        load_weights_into(d, weights_file, dtype)
        return d
