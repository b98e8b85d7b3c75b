"""The semi-autoregressive drafter: the target's hidden state for distant tokens, a tiny LM (TLM) for the drafts.

q(d_j | ...) = head([h ; h_q(d_1 .. d_{j-1})]) where h is the target's post-norm hidden state at the position
before g0 and d_1 = g0 (the paper's w_{i+1}). Two TLMs, both from the paper, both of width D (default H/2):

- "transformer" (simplified transformer): m_l = MLP(e(d_l)) (two SiLU layers of D), and fixed, learned,
  position-based attention: h_q = sum_l softmax(alpha)_l m_l over the draft positions l <= j (alpha: one logit
  per position, normalised over the positions seen so far). Kept incrementally as a running numerator and
  denominator, so a beam-search step costs one MLP.
- "lstm": a 2-layer LSTM over e(d_1) .. e(d_j); h_q = the top layer's hidden state.

The head is the ReDrafter head's shape: in_proj([h ; h_q]) -> E, `num_layers` ResBlocks, vocabulary projection
(K rows; a frequent-token draft vocabulary like the ReDrafter `draft_vocab_size` extension). Drafting is
`beam_search` (W = 1: greedy), which sees this class through `initial_state` / `next_state` / `logits` /
`token_ids`; the state is one array per beam (the TLM's memory, flattened).

Checkpoint: config.json {"model_type": "semi_ar_drafter", "tlm", "tlm_dim", "exit_dim", "num_layers",
"max_draft_len", "hidden_size", "vocab_size", optional "draft_vocab_size"} + model.safetensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import mlx.core as mx
import mlx.nn as nn

from mlx_redrafter.draft.beam_search import BeamSource
from mlx_redrafter.draft.head import HeadArgs, HeadDrafter
from mlx_redrafter.draft.redrafter import ResBlock
from mlx_redrafter.errors import UserError
from mlx_redrafter.schema import MAX_DRAFT_LAYERS, MAX_WIDTH, Field

MODEL_TYPE = "semi_ar_drafter"
TLMS = ("transformer", "lstm")
_MAX_LOGIT = 30.0  # attention logits are clipped so exp() never overflows in the running sums


@dataclass(kw_only=True)
class SemiARArgs(HeadArgs):
    """A semi-AR drafter's config.json."""

    tlm: str  # "transformer" (simplified transformer) or "lstm"
    tlm_dim: int  # D: the TLM's width (the paper: H/2)
    exit_dim: int  # E: the head's width
    num_layers: int = 1  # ResBlocks in the head
    max_draft_len: int = 8  # attention positions of the simplified transformer (later positions share the last)
    model_type: str = MODEL_TYPE
    FIELDS: ClassVar[tuple[Field, ...]] = (
        *HeadArgs.FIELDS, Field("tlm", str, choices=TLMS, required=True),
        Field("tlm_dim", int, 1, MAX_WIDTH, required=True), Field("exit_dim", int, 1, MAX_WIDTH, required=True),
        Field("num_layers", int, 0, MAX_DRAFT_LAYERS), Field("max_draft_len", int, 1, 1024))
    KIND: ClassVar[str] = "semi-AR drafter"


class SemiARDrafter(HeadDrafter):
    """Semi-autoregressive drafter (see the module docstring)."""

    ARGS = SemiARArgs

    def __init__(self, args: SemiARArgs):
        super().__init__(args)
        if args.tlm not in TLMS:
            raise UserError(f"unknown semi-AR TLM {args.tlm!r}: choose {', '.join(TLMS)}")
        H, D, E = args.hidden_size, args.tlm_dim, args.exit_dim
        if args.tlm == "transformer":
            self.mlp = [nn.Linear(H, D), nn.Linear(D, D)]
            self.alpha = mx.zeros((args.max_draft_len,))  # attention logits per draft position
        else:
            self.lstm = [nn.LSTM(H, D), nn.LSTM(D, D)]
        self.in_proj = nn.Linear(H + D, E)
        self.lm_head = [ResBlock(E) for _ in range(args.num_layers)] + [nn.Linear(E, args.head_rows, bias=False)]

    # --- the TLM -------------------------------------------------------------------------------------------
    @property
    def state_dim(self) -> int:
        """Width of one beam's state: [numerator D, denominator 1, position 1] or [h1, c1, h2, c2]."""
        D = self.args.tlm_dim
        return D + 2 if self.args.tlm == "transformer" else 4 * D

    def _embed_mlp(self, e: mx.array) -> mx.array:
        for layer in self.mlp:
            e = nn.silu(layer(e))
        return e

    def _weight(self, pos: mx.array) -> mx.array:
        """exp(alpha) at draft positions `pos` (clipped to the last position)."""
        p = mx.minimum(pos, self.args.max_draft_len - 1)
        return mx.exp(mx.clip(self.alpha[p], -_MAX_LOGIT, _MAX_LOGIT))

    def initial_state(self, batch: int, width: int, dtype: mx.Dtype) -> mx.array:
        """State before any draft token: zeros (B, W, state_dim)."""
        return mx.zeros((batch, width, self.state_dim), dtype=dtype)

    def next_state(self, state: mx.array, token_emb: mx.array) -> mx.array:
        """Consume the embedding of the last drafted token: (..., state_dim), (..., H) -> (..., state_dim)."""
        D = self.args.tlm_dim
        if self.args.tlm == "transformer":
            num, den, pos = state[..., :D], state[..., D : D + 1], state[..., D + 1 :]
            w = self._weight(pos.astype(mx.int32)).astype(state.dtype)  # (..., 1)
            return mx.concatenate([num + w * self._embed_mlp(token_emb), den + w, pos + 1], axis=-1)
        h1, c1, h2, c2 = (state[..., i * D : (i + 1) * D] for i in range(4))
        h1, c1 = (a[..., 0, :] for a in self.lstm[0](token_emb[..., None, :], h1, c1))
        h2, c2 = (a[..., 0, :] for a in self.lstm[1](h1[..., None, :], h2, c2))
        return mx.concatenate([h1, c1, h2, c2], axis=-1)

    def tlm_output(self, state: mx.array) -> mx.array:
        """h_q (..., D) of a state."""
        D = self.args.tlm_dim
        if self.args.tlm == "transformer":
            return state[..., :D] / state[..., D : D + 1]
        return state[..., 2 * D : 3 * D]

    # --- the head ------------------------------------------------------------------------------------------
    def head(self, context: mx.array, h_q: mx.array) -> mx.array:
        """Logits (..., K) from [h ; h_q]."""
        x = self.in_proj(mx.concatenate([context, h_q], axis=-1))
        for layer in self.lm_head:
            x = layer(x)
        return x

    def logits(self, context: mx.array, state: mx.array) -> mx.array:
        """Head logits (..., K) for context (..., H) and a TLM state (..., state_dim)."""
        return self.head(context, self.tlm_output(state))

    def teacher_forced_logits(self, h: mx.array, emb_in: mx.array) -> mx.array:
        """Training view (B, T, K): step j reads h and the TLM over x_{p+1} .. x_{p+j} (what beam search computes
        one token at a time, here in parallel)."""
        B, T, _ = emb_in.shape
        if self.args.tlm == "transformer":
            w = self._weight(mx.arange(T))[None, :, None].astype(emb_in.dtype)  # (1, T, 1)
            h_q = mx.cumsum(w * self._embed_mlp(emb_in), axis=1) / mx.cumsum(w, axis=1)
        else:
            x, _ = self.lstm[0](emb_in)
            h_q, _ = self.lstm[1](x)
        return self.head(mx.broadcast_to(h[:, None, :], (B, T, h.shape[-1])), h_q)


class SemiARSource(BeamSource):
    """Semi-AR drafting: W beams of length L by `beam_search` (W = 1 is greedy drafting)."""

    name = "semi_ar"


def random_semi_ar(hidden_size: int, vocab_size: int, seed: int, tlm: str = "transformer",
                   tlm_dim: int | None = None, exit_dim: int | None = None, num_layers: int = 1,
                   draft_vocab_size: int | None = None, dtype: mx.Dtype = mx.float32) -> SemiARDrafter:
    """A randomly initialised semi-AR drafter (exactness tests, smoke runs); D = H/2 and E = H by default."""
    args = SemiARArgs(vocab_size=vocab_size, hidden_size=hidden_size, tlm=tlm, tlm_dim=tlm_dim or hidden_size // 2,
                      exit_dim=exit_dim or hidden_size, num_layers=num_layers, draft_vocab_size=draft_vocab_size)
    return SemiARDrafter.random(args, seed, dtype)


def load_semi_ar(path, dtype: mx.Dtype | None = mx.float32) -> SemiARDrafter:
    """Load a semi-AR drafter directory (see the module docstring)."""
    return SemiARDrafter.load(path, dtype)
