"""Greedy autoregressive and greedy ReDrafter decoding in PyTorch (reference loops)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from .drafter import TorchDrafter, beam_search
from .target import cache_len, commit_path, forward, new_cache
from .tree import pack


@dataclass
class RefStats:
    steps: int = 0
    accepted: list[int] = field(default_factory=list)  # accepted drafts per step
    verified_tokens: int = 0


def _emit(out: list[int], new: list[int], max_tokens: int, eos: set[int]) -> bool:
    """Append new tokens up to eos / max_tokens; True when generation is over."""
    for t in new:
        if t in eos:
            return True
        out.append(t)
        if len(out) >= max_tokens:
            return True
    return False


@torch.no_grad()
def greedy_ar(model: Any, prompt: list[int], max_tokens: int, eos_ids: Iterable[int] = (),
              device: str = "cpu") -> list[int]:
    """Plain greedy decoding with a KV cache; prompt at positions 0..n-1."""
    cache = new_cache(model)
    logits, _ = forward(model, torch.tensor([prompt], device=device), cache)
    tok = int(logits[0, -1].argmax())
    out: list[int] = []
    eos = set(eos_ids)
    while not _emit(out, [tok], max_tokens, eos):
        logits, _ = forward(model, torch.tensor([[tok]], device=device), cache)
        tok = int(logits[0, -1].argmax())
    return out


@torch.no_grad()
def greedy_redrafter(model: Any, drafter: TorchDrafter, prompt: list[int], max_tokens: int,
                     eos_ids: Iterable[int] = (), width: int = 4, length: int = 5,
                     device: str = "cpu") -> tuple[list[int], RefStats]:
    """Greedy ReDrafter: draft W beams, pack, verify with a tree mask, accept the longest match, commit its KV."""
    stats = RefStats()
    cache = new_cache(model)
    taps = tuple(drafter.cfg.get("feature_layers") or ())  # the target layers the drafter reads besides the last
    logits, hidden = forward(model, torch.tensor([prompt], device=device), cache, feature_layers=taps)
    g0, h = int(logits[0, -1].argmax()), hidden[:, -1]
    out: list[int] = []
    eos = set(eos_ids)
    if _emit(out, [g0], max_tokens, eos):
        return out, stats
    embed = model.model.embed_tokens
    while True:
        beams, _ = beam_search(drafter, embed, h, torch.tensor([g0], device=device), width, length)
        tree = pack(beams[0])
        ctx = cache_len(cache)
        allowed = torch.cat([torch.ones(tree.size, ctx, dtype=torch.bool, device=device), tree.mask], dim=1)
        logits, hidden = forward(model, tree.tokens[None], cache, (ctx + tree.depth)[None], allowed, taps)
        target_next = logits[0].argmax(-1)[tree.unpacker].tolist()  # (W, L)
        b = beams[0].tolist()
        best, n = 0, -1
        for i in range(width):
            run = 0
            while run < length - 1 and b[i][run + 1] == target_next[i][run]:
                run += 1
            if run > n:
                best, n = i, run
        path = tree.unpacker[best].tolist()
        commit_path(cache, ctx, path[: n + 1])
        g0, h = target_next[best][n], hidden[:, path[n]]
        stats.steps += 1
        stats.accepted.append(n)
        stats.verified_tokens += tree.size
        if _emit(out, b[best][1 : n + 1] + [g0], max_tokens, eos):
            return out, stats
