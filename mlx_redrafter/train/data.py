"""Training examples from corpora and their features: one example per context position.

For a context position p of a sequence x (prompt length P, n tokens; p = P-1 .. n-2), a drafter trained for T
steps starts from the target's hidden state h_p, consumes x_{p+1} .. x_{p+T} (x_{p+1} plays the role of g0, the
token the target already decided) and at step j learns what the target decides at position p+j: its top-1
token (hard labels) or its top-k distribution (soft labels), both from the teacher-forced pass. Steps past the
end of the sequence are masked. Examples may span several corpora (e.g. the target's own answers and fixed
text); hidden states stay memory-mapped per shard. For a drafter that fuses target layers, h_p is the post-norm
state followed by those layers' states (`features.FeaturePaths.layers`), the input of its `context`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from mlx_redrafter.errors import UserError
from mlx_redrafter.train.corpus import Corpus
from mlx_redrafter.train.features import FeaturePaths, load_features


@dataclass
class Examples:
    """All context positions of some shards."""

    tokens: np.ndarray  # (N,) int32: every sequence concatenated
    hidden: list[np.ndarray]  # per shard: (C_s, H) float16 states of its context positions (memory-mapped)
    shard_of: np.ndarray  # (C,) which hidden array holds position c
    row_of: np.ndarray  # (C,) its row there
    top_ids: np.ndarray  # (C, k) int32: the target's k most likely next tokens at c
    top_logp: np.ndarray  # (C, k) float16: their log-probabilities
    tok_index: np.ndarray  # (C,) index into tokens of x_p
    seq_end: np.ndarray  # (C,) index into tokens one past the end of p's sequence
    sequences: int
    response_tokens: int
    by_corpus: dict[str, int] = field(default_factory=dict)  # response tokens per corpus
    taps: list[np.ndarray] | None = None  # per shard: (C_s, n H) float16 states of the tapped layers
    layers: tuple[int, ...] = ()  # the target layers `taps` holds

    def __len__(self) -> int:
        return len(self.tok_index)

    def states(self, idx: np.ndarray) -> np.ndarray:
        """Hidden states (len(idx), H) float32 of context positions `idx`, followed by the tapped layers' (n H)
        where the examples hold some."""
        H = self.hidden[0].shape[1]
        out = np.empty((len(idx), H * (1 + len(self.layers))), np.float32)
        shard = self.shard_of[idx]
        for s in np.unique(shard):
            m = shard == s
            rows = self.row_of[idx[m]]
            out[m, :H] = self.hidden[s][rows]
            if self.taps is not None:
                out[m, H:] = self.taps[s][rows]
        return out


def load_examples(parts: list[tuple[Corpus, dict[str, FeaturePaths], list[str]]]) -> Examples:
    """Examples of the named shards of each corpus (features must exist: see features.ensure)."""
    if not any(names for _, _, names in parts):
        raise UserError("no corpus shards to train on: run `make distill` first")
    toks, hids, taps, shard_of, row_of, ids, logp, ti, ends = [], [], [], [], [], [], [], [], []
    layers = {paths[name].layers for _, paths, names in parts for name in names}
    if len(layers) > 1:
        raise ValueError(f"examples mix features of target layers {sorted(layers)}")
    base = n_seq = n_resp = 0
    by_corpus: dict[str, int] = {}
    for corpus, paths, names in parts:
        for name in names:
            sh = corpus.shard(name)
            f = load_features(paths[name], sh)
            s = len(hids)
            hids.append(f.hidden)
            taps.append(f.taps)
            shard_of.append(np.full(f.hidden.shape[0], s, np.int32))
            row_of.append(np.arange(f.hidden.shape[0], dtype=np.int64))
            ids.append(np.asarray(f.top_ids, np.int32))
            logp.append(np.asarray(f.top_logp, np.float16))
            toks.append(sh.tokens)
            for i in range(sh.num_sequences):
                start, end = int(sh.offsets[i]), int(sh.offsets[i + 1])
                P = int(sh.prompt_len[i])
                p = np.arange(P - 1, end - start - 1)
                ti.append(base + start + p)
                ends.append(np.full(len(p), base + end))
                n_resp += end - start - P
                by_corpus[corpus.name] = by_corpus.get(corpus.name, 0) + end - start - P
            n_seq += sh.num_sequences
            base += len(sh.tokens)
    return Examples(tokens=np.concatenate(toks).astype(np.int32), hidden=hids, shard_of=np.concatenate(shard_of),
                    row_of=np.concatenate(row_of), top_ids=np.concatenate(ids), top_logp=np.concatenate(logp),
                    tok_index=np.concatenate(ti).astype(np.int64), seq_end=np.concatenate(ends).astype(np.int64),
                    sequences=n_seq, response_tokens=n_resp, by_corpus=by_corpus,
                    taps=taps if taps[0] is not None else None, layers=layers.pop())


@dataclass
class Batch:
    h: mx.array  # (B, H) float32 context hidden states
    x_in: mx.array  # (B, T) drafter inputs x_{p+1..p+T}
    target: mx.array  # (B, T) head index of the target's top-1 at p+j (0 where outside the head)
    weight: mx.array  # (B, T) 1 where that label exists and is in the head
    valid: mx.array  # (B, T) 1 where the step exists (inside the sequence)
    soft_index: mx.array | None  # (B, T, k) head index of the target's top-k at p+j (0 outside the head)
    soft_prob: mx.array | None  # (B, T, k) their probabilities renormalized within the head (0 outside)


def make_batch(ex: Examples, idx: np.ndarray, T: int, lut: np.ndarray, soft: bool = False) -> Batch:
    """Gather the examples `idx`; `lut` maps token id -> head index (-1 outside the head)."""
    t0 = ex.tok_index[idx]
    steps = np.arange(1, T + 1)[None, :]
    valid = t0[:, None] + steps < ex.seq_end[idx][:, None] - 1  # p + j <= n - 2: the target decided at p+j
    x = ex.tokens[np.minimum(t0[:, None] + steps, len(ex.tokens) - 1)]  # x_{p+1} .. x_{p+T}
    rows = np.where(valid, idx[:, None] + steps, 0)  # context rows of p+j (a sequence's rows are contiguous)
    head = lut[ex.top_ids[rows, 0]]
    w = valid & (head >= 0)
    soft_index = soft_prob = None
    if soft:
        k_head = lut[ex.top_ids[rows]]  # (B, T, k)
        p = np.exp(ex.top_logp[rows].astype(np.float32)) * (k_head >= 0) * valid[..., None]
        p /= np.maximum(p.sum(-1, keepdims=True), 1e-9)
        soft_index, soft_prob = mx.array(np.maximum(k_head, 0)), mx.array(p)
    return Batch(h=mx.array(ex.states(idx)), x_in=mx.array(x), target=mx.array(np.maximum(head, 0)),
                 weight=mx.array(w.astype(np.float32)), valid=mx.array(valid.astype(np.float32)),
                 soft_index=soft_index, soft_prob=soft_prob)


def draft_vocabulary(ex: Examples, k: int, vocab_size: int, always: list[int]) -> np.ndarray:
    """The k tokens the target decides most often in the examples (`always` ids included), most frequent first."""
    counts = np.bincount(ex.top_ids[:, 0], minlength=vocab_size).astype(np.float64)
    counts[np.asarray(always, dtype=np.int64)] = np.inf
    return np.argsort(-counts, kind="stable")[: min(k, vocab_size)].astype(np.int32)
