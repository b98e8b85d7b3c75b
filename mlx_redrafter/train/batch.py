"""Batches of token sequences of different lengths for one target forward (generation and teacher forcing)."""

from __future__ import annotations

import numpy as np


def left_padded(seqs: list[list[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Left-padded batch: tokens (B, N), positions (B, N) from 0 at each row's first real token, mask
    (B, 1, N, N) causal over real tokens (a pad query sees only itself), and the pad length of each row."""
    lens = np.array([len(s) for s in seqs])
    n = int(lens.max())
    pad = n - lens
    tok = np.full((len(seqs), n), pad_id, dtype=np.int32)
    for b, s in enumerate(seqs):
        tok[b, pad[b]:] = s
    cols = np.arange(n)
    positions = np.maximum(cols[None, :] - pad[:, None], 0).astype(np.int32)
    real_key = cols[None, :] >= pad[:, None]
    mask = ((cols[None, :] <= cols[:, None])[None] & real_key[:, None, :]) | np.eye(n, dtype=bool)[None]
    return tok, positions, mask[:, None], pad
