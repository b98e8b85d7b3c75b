"""ReDrafter drafter in PyTorch with Apple's parameter names, and its beam search."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

LOG_0 = -50000.0  # the reference implementation's finite log(0)


class ResBlock(nn.Module):
    """x + SiLU(W x + b)."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class TorchDrafter(nn.Module):
    """Apple's drafter: optional input_proj, N ResBlocks + vocab projection in `lm_head`, RNN rnn_u / rnn_w."""

    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        self.cfg = dict(cfg)
        H, E, V = cfg["hidden_size"], cfg["exit_dim"], cfg["vocab_size"]
        if E != 2 * H:
            self.input_proj = nn.Linear(2 * H, E, bias=True)
        K = cfg.get("draft_vocab_size") or V  # redrafter-mlx extension: a head over K token ids
        self.lm_head = nn.Sequential(*[ResBlock(E) for _ in range(cfg["num_draft_layers"])],
                                     nn.Linear(E, K, bias=False))
        if cfg.get("draft_vocab_size"):
            self.register_buffer("draft_vocab", torch.arange(K, dtype=torch.long))
        self.rnn = bool(cfg.get("rnn", False))
        if self.rnn:
            self.rnn_u = nn.Linear(H, H, bias=True)
            self.rnn_w = nn.Linear(H, H, bias=False)
        if cfg.get("feature_layers"):  # redrafter-mlx extension: the context fuses tapped target layers
            self.fuse = nn.Linear(H * (len(cfg["feature_layers"]) + 1), H, bias=False)
        if cfg.get("emb_norm"):
            self.emb_norm = nn.Module()
            self.emb_norm.weight = nn.Parameter(torch.ones(H))  # in the format; unused in the forward

    def next_state(self, state: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        if self.rnn:
            return nn.functional.silu(self.rnn_w(emb) + self.rnn_u(state))
        return state + emb

    def context(self, hidden: torch.Tensor) -> torch.Tensor:
        """The context the head conditions on, from the target's features (..., H * (1 + len(feature_layers))):
        the post-norm state, then each tapped layer's output divided by its RMS (mlx_redrafter's Drafter.context)."""
        H = self.cfg["hidden_size"]
        return self.fuse(hidden) if hasattr(self, "fuse") else hidden[..., :H]

    def token_ids(self, head_index: torch.Tensor) -> torch.Tensor:
        """Head output index -> target token id."""
        return self.draft_vocab[head_index] if hasattr(self, "draft_vocab") else head_index

    def logits(self, context: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        x = torch.cat([context, state], dim=-1)
        if hasattr(self, "input_proj"):
            x = self.input_proj(x)
        return self.lm_head(x)


def random_torch_drafter(hidden_size: int, vocab_size: int, exit_dim: int | None = None, num_draft_layers: int = 2,
                         rnn: bool = True, seed: int = 0, scale: float = 1.0) -> TorchDrafter:
    """A randomly initialised fp32 drafter (torch's default Linear init, weights times `scale`)."""
    torch.manual_seed(seed)
    d = TorchDrafter({"model_type": "recurrent_drafting_drafter", "vocab_size": vocab_size,
                      "hidden_size": hidden_size, "exit_dim": exit_dim or 2 * hidden_size,
                      "num_draft_layers": num_draft_layers, "rnn": rnn, "num_lookback_tokens": 1})
    with torch.no_grad():
        for p in d.parameters():
            p.mul_(scale)
    return d.float().eval()


def from_mlx(drafter: Any, device: str = "cpu") -> TorchDrafter:
    """A TorchDrafter holding the weights of an mlx_redrafter Drafter (fp32)."""
    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten

    d = TorchDrafter(drafter.args.to_dict())
    sd = {}
    for k, v in tree_flatten(drafter.parameters()):
        arr = np.array(v.astype(mx.int64 if k == "draft_vocab" else mx.float32))
        sd[k] = torch.from_numpy(arr)
    d.load_state_dict(sd, strict=True)
    return d.float().eval().to(device)


def warp(logits: torch.Tensor, top_k: int = 50) -> torch.Tensor:
    """Subtract the row max, then set everything below the k-th largest value to LOG_0."""
    logits = logits - logits.max(dim=-1, keepdim=True).values
    k = min(top_k, logits.shape[-1])
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, LOG_0)


@torch.no_grad()
def beam_search(drafter: TorchDrafter, embed: Callable[[torch.Tensor], torch.Tensor], context: torch.Tensor,
                first_token: torch.Tensor, width: int, length: int,
                top_k: int = 50) -> tuple[torch.Tensor, torch.Tensor]:
    """Beams (B, W, L) with column 0 = first_token, and the chosen tokens' log-probs (B, W, L-1).

    Initial beam scores are [0, -inf, ...] so step 1 grows W distinct beams out of the first; candidates are
    ranked by total log-prob, ties broken by lower flat index (beam * V + token), best beam first.
    """
    context = drafter.context(context)
    B, H = context.shape
    ctx = context[:, None, :].expand(B, width, H)
    beams = first_token.long()[:, None, None].expand(B, width, 1)
    scores = torch.full((B, width), float("-inf"), device=context.device)
    scores[:, 0] = 0.0
    state = torch.zeros(B, width, H, dtype=context.dtype, device=context.device)
    chosen_lp = torch.zeros(B, width, 0, device=context.device)
    rows = torch.arange(B, device=context.device)[:, None]
    for _ in range(length - 1):
        state = drafter.next_state(state, embed(beams[:, :, -1]))
        logp = torch.log_softmax(warp(drafter.logits(ctx, state).float(), top_k), dim=-1)  # (B, W, V)
        V = logp.shape[-1]
        total = (logp + scores[:, :, None]).reshape(B, width * V)
        scores, flat = torch.topk(total, width, dim=-1, sorted=True)
        src, tok = flat // V, drafter.token_ids(flat % V)
        beams = torch.cat([beams[rows, src], tok[:, :, None]], dim=-1)
        state = state[rows, src]
        chosen_lp = torch.cat([chosen_lp[rows, src], logp.reshape(B, width * V).gather(1, flat)[:, :, None]], dim=-1)
    return beams, chosen_lp
