"""Prefix dedup and packing of beams with plain loops (the reference for mlx_redrafter.tree)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TorchTree:
    tokens: torch.Tensor  # (P,)
    depth: torch.Tensor  # (P,)
    mask: torch.Tensor  # (P, P) bool: packed token a sees b (its ancestors and itself)
    unpacker: torch.Tensor  # (W, L) packed index of each beam slot
    size: int


def pack(beams: torch.Tensor) -> TorchTree:
    """Pack one sequence's beams (W, L): a token is stored once per distinct prefix, in beam-major order."""
    b = beams.tolist()
    W, L = len(b), len(b[0])
    index: dict[tuple[int, ...], int] = {}
    tokens: list[int] = []
    depth: list[int] = []
    parent: list[int] = []
    unpacker = [[0] * L for _ in range(W)]
    for i in range(W):
        for k in range(L):
            key = tuple(b[i][: k + 1])
            if key not in index:
                index[key] = len(tokens)
                tokens.append(b[i][k])
                depth.append(k)
                parent.append(index[key[:-1]] if k else -1)
            unpacker[i][k] = index[key]
    P = len(tokens)
    mask = torch.zeros(P, P, dtype=torch.bool)
    for a in range(P):
        j = a
        while j >= 0:
            mask[a, j] = True
            j = parent[j]
    dev = beams.device
    return TorchTree(torch.tensor(tokens, device=dev), torch.tensor(depth, device=dev), mask.to(dev),
                     torch.tensor(unpacker, device=dev), P)
