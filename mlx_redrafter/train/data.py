"""Training examples from the corpus and its features: one example per context position.

For a context position p of a sequence x (prompt length P, n tokens; p = P-1 .. n-2) with the target's hidden
state h_p, a drafter trained for T steps consumes x_{p+1} .. x_{p+T} (x_{p+1} is the token the target decided
at p, the g0 of inference) and predicts x_{p+2} .. x_{p+T+1}; steps past the end of the sequence are masked.
With soft labels, the target at step j is the target's own distribution at position p+j, computed from h_{p+j}.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_redrafter.errors import UserError
from mlx_redrafter.train.corpus import Corpus, load_shard
from mlx_redrafter.train.features import load_features


@dataclass
class Examples:
    """All context positions of some shards, in memory."""

    tokens: np.ndarray  # (N,) int32 every sequence concatenated
    hidden: np.ndarray  # (C, H) float16 hidden state of every context position
    tok_index: np.ndarray  # (C,) index into tokens of x_p
    seq_end: np.ndarray  # (C,) index into tokens one past the end of p's sequence
    sequences: int
    response_tokens: int

    def __len__(self) -> int:
        return len(self.tok_index)

    def subset_sequences(self, fraction: float, seed: int = 0) -> Examples:
        """The examples of a random share of the sequences (for corpus-size ablations)."""
        ends = np.unique(self.seq_end)
        rng = np.random.default_rng(seed)
        keep_ends = set(rng.choice(ends, size=max(1, round(fraction * len(ends))), replace=False).tolist())
        m = np.array([e in keep_ends for e in self.seq_end.tolist()])
        starts = self.tok_index[m]
        return Examples(self.tokens, self.hidden[m] if isinstance(self.hidden, np.ndarray) else self.hidden[m],
                        starts, self.seq_end[m], len(keep_ends), int(m.sum()))


def load_examples(corpus: Corpus, feature_paths: dict[str, Path], names: list[str]) -> Examples:
    """Examples of the given corpus shards (features must exist: see features.ensure)."""
    if not names:
        raise UserError(f"corpus {corpus.root} has no shards to train on: run `make distill` first")
    toks, hids, ti, ends = [], [], [], []
    base = n_seq = n_resp = 0
    for name in names:
        sh = load_shard(corpus.root / name)
        hids.append(np.asarray(load_features(feature_paths[name], sh)))
        toks.append(sh.tokens)
        for i in range(sh.num_sequences):
            start, end = int(sh.offsets[i]), int(sh.offsets[i + 1])
            P = int(sh.prompt_len[i])
            p = np.arange(P - 1, end - start - 1)
            ti.append(base + start + p)
            ends.append(np.full(len(p), base + end))
            n_resp += end - start - P
        n_seq += sh.num_sequences
        base += len(sh.tokens)
    return Examples(tokens=np.concatenate(toks).astype(np.int32), hidden=np.concatenate(hids),
                    tok_index=np.concatenate(ti).astype(np.int64), seq_end=np.concatenate(ends).astype(np.int64),
                    sequences=n_seq, response_tokens=n_resp)


@dataclass
class Batch:
    h: mx.array  # (B, H) float32 context hidden states
    x_in: mx.array  # (B, T) drafter inputs x_{p+1..p+T}
    target: mx.array  # (B, T) head index of x_{p+2..p+T+1} (0 where outside the head)
    weight: mx.array  # (B, T) 1 where the target exists and is in the head
    valid: mx.array  # (B, T) 1 where the target exists
    h_next: mx.array | None  # (B, T, H) hidden states at p+1..p+T (soft labels), zeros where invalid


def make_batch(ex: Examples, idx: np.ndarray, T: int, lut: np.ndarray, soft: bool = False) -> Batch:
    """Gather the examples `idx`; `lut` maps token id -> head index (-1 outside the head)."""
    t0 = ex.tok_index[idx]
    where = t0[:, None] + np.arange(1, T + 2)[None, :]  # x_{p+1} .. x_{p+T+1}
    valid = where < ex.seq_end[idx][:, None]
    x = ex.tokens[np.minimum(where, len(ex.tokens) - 1)]
    head = lut[x[:, 1:]]
    w = valid[:, 1:] & (head >= 0)
    h_next = None
    if soft:  # h_{p+j}, j = 1..T: the rows right after p's (context positions of one sequence are contiguous)
        rows = idx[:, None] + np.arange(1, T + 1)[None, :]
        ok = valid[:, 1:] & (rows < len(ex))
        h_next = mx.array(np.where(ok[..., None], ex.hidden[np.minimum(rows, len(ex) - 1)], 0).astype(np.float32))
    return Batch(h=mx.array(ex.hidden[idx].astype(np.float32)), x_in=mx.array(x[:, :-1]),
                 target=mx.array(np.maximum(head, 0)), weight=mx.array(w.astype(np.float32)),
                 valid=mx.array(valid[:, 1:].astype(np.float32)), h_next=h_next)


def draft_vocabulary(ex: Examples, k: int, vocab_size: int, always: list[int]) -> np.ndarray:
    """The k most frequent token ids of the examples' token stream (`always` ids included), int32."""
    counts = np.bincount(ex.tokens, minlength=vocab_size).astype(np.float64)
    counts[np.asarray(always, dtype=np.int64)] = np.inf
    return np.argsort(-counts, kind="stable")[: min(k, vocab_size)].astype(np.int32)
