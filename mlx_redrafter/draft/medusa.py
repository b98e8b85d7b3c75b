"""Medusa-1 heads on the frozen target, and the draft source that proposes a static Medusa tree.

Head k (k = 0 .. K-1) = `medusa_num_layers` ResBlocks (x + SiLU(W x + b)) and a vocabulary projection (no bias) on
the target's post-norm hidden state h at the position before g0 (the token the target decided there): head k
predicts the token k+1 positions after g0 (the target's own head predicts g0 itself), as in Medusa.

Checkpoint (ours): config.json {"model_type": "medusa", "medusa_num_heads", "medusa_num_layers", "hidden_size",
"vocab_size", optional "draft_vocab_size"} + model.safetensors with FasterDecoding/Medusa's key layout under a
`medusa_head.` prefix: `medusa_head.{k}.{i}.linear.weight/bias` (ResBlock i) and `medusa_head.{k}.{L}.weight`
(the projection, (K, H)); plus `draft_vocab` with a draft vocabulary. PyTorch checkpoints in the FasterDecoding
layout (`medusa_lm_head.safetensors` / `.pt`) convert with `python -m convert.from_torch`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import mlx.core as mx
import mlx.nn as nn

from mlx_redrafter.draft.base import PAD, DecodeState, Source
from mlx_redrafter.draft.head import HeadArgs, HeadDrafter
from mlx_redrafter.draft.medusa_trees import DEFAULT_TREE, TreePath, check_tree, parse_tree, tree_index
from mlx_redrafter.draft.redrafter import ResBlock
from mlx_redrafter.errors import UserError
from mlx_redrafter.schema import MAX_DRAFT_LAYERS, Field

MODEL_TYPE = "medusa"
MAX_MEDUSA_HEADS = 64


@dataclass(kw_only=True)
class MedusaArgs(HeadArgs):
    """A Medusa checkpoint's config.json (FasterDecoding's key names + the target's sizes)."""

    medusa_num_heads: int
    medusa_num_layers: int = 1
    model_type: str = MODEL_TYPE
    FIELDS: ClassVar[tuple[Field, ...]] = (*HeadArgs.FIELDS, Field("medusa_num_heads", int, 1, MAX_MEDUSA_HEADS,
                                                                   required=True),
                                           Field("medusa_num_layers", int, 0, MAX_DRAFT_LAYERS))
    KIND: ClassVar[str] = "Medusa drafter"


class MedusaHeads(HeadDrafter):
    """K Medusa heads; `logits(h, n)` runs the first n of them on the same hidden state."""

    ARGS = MedusaArgs

    def __init__(self, args: MedusaArgs):
        super().__init__(args)
        H = args.hidden_size
        self.medusa_head = [
            [ResBlock(H) for _ in range(args.medusa_num_layers)] + [nn.Linear(H, args.head_rows, bias=False)]
            for _ in range(args.medusa_num_heads)
        ]

    @property
    def num_heads(self) -> int:
        return self.args.medusa_num_heads

    def head_logits(self, h: mx.array, k: int) -> mx.array:
        """Head k's logits (..., K) from hidden states (..., H)."""
        x = h
        for layer in self.medusa_head[k]:
            x = layer(x)
        return x

    def logits(self, h: mx.array, n: int | None = None) -> mx.array:
        """The first n heads' logits (..., n, K) (n = all heads by default)."""
        n = self.num_heads if n is None else n
        return mx.stack([self.head_logits(h, k) for k in range(n)], axis=-2)

    def teacher_forced_logits(self, h: mx.array, emb_in: mx.array) -> mx.array:
        """Training view (B, T, K): step j is head j on h alone (Medusa ignores the drafted tokens `emb_in`)."""
        T = emb_in.shape[1]
        if T > self.num_heads:
            raise UserError(f"a Medusa drafter with {self.num_heads} heads cannot be trained for {T} draft steps")
        return self.logits(h, T)


def random_medusa(hidden_size: int, vocab_size: int, seed: int, num_heads: int = 4, num_layers: int = 1,
                  draft_vocab_size: int | None = None, dtype: mx.Dtype = mx.float32) -> MedusaHeads:
    """Randomly initialised Medusa heads (exactness tests, smoke runs)."""
    args = MedusaArgs(vocab_size=vocab_size, hidden_size=hidden_size, medusa_num_heads=num_heads,
                      medusa_num_layers=num_layers, draft_vocab_size=draft_vocab_size)
    return MedusaHeads.random(args, seed, dtype)


def load_medusa(path, dtype: mx.Dtype | None = mx.float32) -> MedusaHeads:
    """Load an MLX Medusa drafter directory (see the module docstring)."""
    return MedusaHeads.load(path, dtype)


def top_tokens(logits: mx.array, k: int) -> mx.array:
    """(n, K) logits -> (n, k) head indices of each row's k largest, best first (no host sync)."""
    if k < logits.shape[-1]:
        part = mx.argpartition(-logits, kth=k - 1, axis=-1)[:, :k]
    else:
        part = mx.broadcast_to(mx.arange(logits.shape[-1]), logits.shape)
    order = mx.argsort(-mx.take_along_axis(logits, part, axis=-1), axis=-1)
    return mx.take_along_axis(part, order, axis=-1)


class MedusaSource(Source):
    """Proposes a static Medusa tree as its root-to-leaf paths: column 0 = g0, then along each path the heads'
    top-k tokens of the path's ranks, PAD after the path's end. The tree is cut at min(L-1, heads) levels; a
    width below the number of paths keeps the first `width` paths (in the tree's order)."""

    name = "medusa"

    def __init__(self, heads: MedusaHeads, tree: str | list[TreePath] | tuple[TreePath, ...] = DEFAULT_TREE):
        self.heads = heads
        self.tree = parse_tree(tree) if isinstance(tree, str) else check_tree(tree)
        need = max(max(p) for p in self.tree) + 1
        if need > heads.args.head_rows:
            raise UserError(f"the Medusa tree uses top-{need} choices but the heads have only "
                            f"{heads.args.head_rows} outputs")
        self._plans: dict[tuple[int, int], _Plan] = {}

    def num_paths(self, length: int) -> int:
        """Candidates proposed at candidate length `length` with no width limit (the whole cut tree)."""
        return self._plan(length, len(self.tree)).n

    def _plan(self, length: int, width: int) -> _Plan:
        """Index arrays of the candidates for this length and width, built once per pair (host-side)."""
        key = (length, min(width, len(self.tree)))
        if key not in self._plans:
            levels = min(length - 1, self.heads.num_heads, max(len(p) for p in self.tree))
            ix = tree_index(self.tree, levels, length - 1, max_paths=key[1])
            self._plans[key] = _Plan(heads=mx.array(ix.heads), ranks=mx.array(ix.ranks), valid=mx.array(ix.valid),
                                     n=ix.heads.shape[0], top=ix.top, levels=levels)
        return self._plans[key]

    def propose(self, state: DecodeState, length: int, width: int) -> mx.array | None:
        plan = self._plan(length, width)
        if plan.n == 0:
            return None
        logits = self.heads.logits(self.heads.context(state.h[0]), plan.levels)  # (levels, K)
        tokens = self.heads.token_ids(top_tokens(logits, plan.top)).astype(mx.int32)  # (levels, top), best first
        body = mx.where(plan.valid, tokens[plan.heads, plan.ranks], PAD)  # (n, L-1)
        g0 = mx.broadcast_to(state.g0.astype(mx.int32)[None, :1], (plan.n, 1))
        return mx.concatenate([g0, body], axis=1)


@dataclass(frozen=True)
class _Plan:
    """A tree's candidates at one (length, width), as MLX index arrays (see medusa_trees.TreeIndex)."""

    heads: mx.array
    ranks: mx.array
    valid: mx.array
    n: int  # candidates
    top: int  # top-k needed per head
    levels: int  # heads used
