"""Growing a drafter's vocabulary head by the tokens the target decides often that the head lacks.

A drafter with a draft vocabulary (`draft_vocab_size`) drafts only the tokens of its head, most frequent first; a
token outside it is never proposed, so every draft position where the target decides one is lost. A head chosen
on an early, small corpus goes stale as the corpus grows: the shipped round-7 head (chosen in round 1) covers
~94% of today's corpus answers and ~91.5% of MT-bench's, where the 8,192 most frequent tokens of today's corpus
would cover ~97.4%.

`grow_head` appends rows for the most frequent missing tokens. Each starts as the target's own output row for
its token, carried into the head's space by the least-squares linear map from the target's rows of the tokens the
head has to the head's trained rows: the new rows start with the geometry the trained ones have (4,096 of them
left the shipped drafter's MT-bench acceptance exactly as it was), and training then learns them. NumPy only: the
MLX trainer and the CUDA job share it.
"""

from __future__ import annotations

import numpy as np


def grow_head(head: np.ndarray, vocab: np.ndarray, target_rows: np.ndarray, counts: np.ndarray,
              size: int) -> tuple[np.ndarray, np.ndarray]:
    """(head rows (size, E), draft vocabulary (size,)): `head` (K, E) over token ids `vocab` (K,), followed by rows
    for the `size - K` tokens with the highest `counts` (V,) that `vocab` lacks (ties: lower id first), each from
    the target's output row `target_rows` (V, H) through the least-squares map H -> E fitted on `vocab`'s rows."""
    k = len(vocab)
    if not k <= size <= len(counts):
        raise ValueError(f"a head of {k} rows grows to {k}..{len(counts)} rows, not {size}")
    if size == k:
        return head, vocab
    have = np.zeros(len(counts), dtype=bool)
    have[np.asarray(vocab, dtype=np.int64)] = True
    order = np.argsort(-np.asarray(counts, dtype=np.float64), kind="stable")
    new = order[~have[order]][: size - k]
    src = np.asarray(target_rows, dtype=np.float64)
    to_head = np.linalg.lstsq(src[vocab], np.asarray(head, dtype=np.float64), rcond=None)[0]  # (H, E)
    rows = (src[new] @ to_head).astype(head.dtype)
    return np.concatenate([head, rows]), np.concatenate([vocab, new.astype(vocab.dtype)])
