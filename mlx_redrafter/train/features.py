"""The teacher-forced feature engine: everything a drafter trains on, from one float32 forward of the target.

For a token sequence (prompt length P, n tokens), a context position p = P-1 .. n-2 is where the drafter starts:
it sees the target's post-norm hidden state h_p and learns to predict what the target decides at p+1, p+2, ...
One batched forward of the runtime's own model over the sequence gives, at every context position, h_p and the
target's own top-k next-token distribution (ids and log-probabilities): the labels come from the target, never
from the text, so fixed text and the target's own answers train the same way.

Per shard of a corpus, in a local cache keyed by the shard's sha256 (a regenerated shard never meets stale data):

    <cache>/<corpus>/shard-XXXXX-<sha12>.npy          hidden (contexts, H) float16
    <cache>/<corpus>/shard-XXXXX-<sha12>.labels.npz   top_ids (contexts, k) int32, top_logp (contexts, k) float16
    <cache>/<corpus>/shard-XXXXX-<sha12>.taps-2-15-24.npy   (contexts, 3 H) float16, only for drafters that fuse
                                                      target layers (here 2, 15 and 24): each layer's output over
                                                      its RMS, as `Model` returns them beside the last state

A greedy corpus keeps the states its generation computed anyway (`save_hidden`: the last state, and the tapped
layers' states where the data job was told which, by default the shipped drafter's); labels missing beside stored
states are computed from them (the output layer only, a fifth of a forward); anything else gets the full
teacher-forced pass.
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_redrafter.errors import UserError
from mlx_redrafter.files import write_atomic
from mlx_redrafter.model import Model, forward_chunked
from mlx_redrafter.system.vector_math import log_probs_at, top_k
from mlx_redrafter.train.batch import left_padded
from mlx_redrafter.train.corpus import Corpus, Shard, load_shard

TOP_K = 8  # labels kept per position: the target's k most likely next tokens
LOGIT_ROWS = 1024  # rows of vocabulary logits computed at once (49k-wide float32 rows)


@dataclass
class FeaturePaths:
    hidden: Path
    labels: Path
    taps: Path | None = None  # the tapped layers' states, where a drafter fuses some
    layers: tuple[int, ...] = ()  # which layers `taps` holds


def feature_paths(root: str | Path, shard_name: str, sha256: str, layers: tuple[int, ...] = ()) -> FeaturePaths:
    """Where a shard's features live; with `layers`, the tapped states of those target layers too."""
    stem = f"{Path(shard_name).stem}-{sha256[:12]}"
    taps = Path(root) / f"{stem}.taps-{'-'.join(map(str, layers))}.npy" if layers else None
    return FeaturePaths(Path(root) / f"{stem}.npy", Path(root) / f"{stem}.labels.npz", taps, tuple(layers))


def _npy_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


def save_hidden(root: str | Path, shard_name: str, sha256: str, per_sequence: list[np.ndarray],
                layers: tuple[int, ...] = ()) -> Path:
    """Store per-sequence (m_i, H) states of a shard as its hidden file (float16, atomic); with `layers`, states
    (m_i, H * (1 + len(layers))) as a tapping forward returns them: the tapped layers' part goes to the taps file
    (written first: a hidden file present means the shard's states are complete)."""
    W = next((h.shape[1] for h in per_sequence if h.ndim == 2), 0)
    arr = np.concatenate([np.zeros((0, W), np.float16)] + [h.astype(np.float16) for h in per_sequence])
    paths = feature_paths(root, shard_name, sha256, layers)
    H = W // (1 + len(layers))
    if paths.taps is not None:
        write_atomic(paths.taps, _npy_bytes(np.ascontiguousarray(arr[:, H:])))
    return write_atomic(paths.hidden, _npy_bytes(np.ascontiguousarray(arr[:, :H])))


def _save_labels(path: Path, ids: np.ndarray, logp: np.ndarray) -> None:
    buf = io.BytesIO()
    np.savez(buf, top_ids=ids.astype(np.int32), top_logp=logp.astype(np.float16))
    write_atomic(path, buf.getvalue())


def context_count(shard: Shard) -> int:
    return int((shard.offsets[1:] - shard.offsets[:-1] - shard.prompt_len).sum())


def top_labels(model: Model, hidden: mx.array, k: int = TOP_K) -> tuple[mx.array, mx.array]:
    """The target's k most likely next tokens and their log-probabilities (most likely first) at hidden states
    (n, H): (n, k) int32 and (n, k) float32, computed in float32 (lazy)."""
    logits = model.logits(hidden.astype(model.dtype)).astype(mx.float32)
    top = top_k(logits, k)  # the logits' top k are the log-probabilities'
    return top, log_probs_at(logits, top)


def _labels_in_chunks(model: Model, hidden: np.ndarray | mx.array, k: int) -> tuple[np.ndarray, np.ndarray]:
    ids, logp = [], []
    for i in range(0, hidden.shape[0], LOGIT_ROWS):
        a, b = top_labels(model, mx.array(hidden[i : i + LOGIT_ROWS]), k)
        mx.eval(a, b)
        ids.append(np.array(a))
        logp.append(np.array(b))
    if not ids:
        return np.zeros((0, k), np.int32), np.zeros((0, k), np.float32)
    return np.concatenate(ids), np.concatenate(logp)


def length_groups(lens: np.ndarray, max_batch_tokens: int) -> list[np.ndarray]:
    """Sequence indices in batches of similar lengths, shortest first: each batch padded to its longest holds at
    most `max_batch_tokens` tokens (a sequence longer than that is a batch of its own)."""
    order = np.argsort(lens, kind="stable")
    groups, i = [], 0
    while i < len(order):
        j = i + 1
        while j < len(order) and (j - i + 1) * lens[order[j]] <= max_batch_tokens:
            j += 1
        groups.append(order[i:j])
        i = j
    return groups


def teacher_forced(model: Model, shard: Shard, pad_id: int, k: int = TOP_K, max_batch_tokens: int = 4096,
                   progress: Callable[[int], None] | None = None, layers: tuple[int, ...] = (),
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(hidden float16 (C, H), top_ids (C, k), top_logp (C, k)) at every context position of the shard, in
    sequence order: one float32 forward per batch of similar-length sequences (left-padded). With `layers`, hidden
    is (C, H * (1 + len(layers))): the post-norm state followed by those layers' states over their RMS, what a
    drafter that fuses them conditions on."""
    with model.tapping(layers):
        return _teacher_forced(model, shard, pad_id, k, max_batch_tokens, progress)


def _teacher_forced(model: Model, shard: Shard, pad_id: int, k: int, max_batch_tokens: int,
                    progress: Callable[[int], None] | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n_seq = shard.num_sequences
    lens = shard.offsets[1:] - shard.offsets[:-1]
    hid: list[np.ndarray | None] = [None] * n_seq
    ids: list[np.ndarray | None] = [None] * n_seq
    logp: list[np.ndarray | None] = [None] * n_seq
    for idx in length_groups(lens, max_batch_tokens):
        seqs = [shard.sequence(q).tolist() for q in idx]
        tok, pos, mask, pad = left_padded(seqs, pad_id)
        _, hidden = forward_chunked(model, model.make_cache(tok.shape[1]), mx.array(tok), mx.array(pos), mx.array(mask),
                                    all_hidden=True)
        spans = [(int(pad[b]) + int(shard.prompt_len[q]) - 1, int(pad[b]) + int(lens[q]) - 1) for b, q in
                 enumerate(idx)]
        ctx = mx.concatenate([hidden[b, s:e] for b, (s, e) in enumerate(spans)])  # float32 states (+ taps)
        top_i, top_v = _labels_in_chunks(model, model.last_state(ctx), k)
        h16 = np.array(ctx.astype(mx.float16))
        start = 0
        for q, (s, e) in zip(idx, spans):
            rows = slice(start, start + e - s)
            hid[q], ids[q], logp[q] = h16[rows], top_i[rows], top_v[rows]
            start += e - s
        if progress is not None:
            progress(int(lens[idx].sum()))
    H = model.args.hidden_size * (1 + len(model.feature_layers))
    cat = lambda parts, shape, dt: np.concatenate([np.zeros(shape, dt)] + parts)  # noqa: E731
    return cat(hid, (0, H), np.float16), cat(ids, (0, k), np.int32), cat(logp, (0, k), np.float32)


def ensure(corpus: Corpus, model: Model, pad_id: int, cache_root: str | Path, names: list[str] | None = None, *,
           worker: tuple[int, int] = (0, 1), progress: bool = True, log: Callable[[str], None] = print,
           layers: tuple[int, ...] = ()) -> dict[str, FeaturePaths]:
    """Feature files for the corpus shards `names` (default: all), building what is missing; with `layers`, the
    tapped states of those target layers too; with `worker=(i, n)` this process builds only the shards at
    positions i modulo n of `names`."""
    names = names if names is not None else sorted(corpus.entries)
    paths = {n: feature_paths(cache_root, n, corpus.entries[n]["sha256"], layers) for n in names}
    mine = [n for q, n in enumerate(names) if q % worker[1] == worker[0]]

    def finished(f: FeaturePaths) -> bool:  # hidden is written last: present means its pass finished
        return f.hidden.exists() and (f.taps is None or f.taps.exists())

    forced = [n for n in mine if not finished(paths[n])]
    relabel = [n for n in mine if finished(paths[n]) and not paths[n].labels.exists()]
    if not forced and not relabel:
        return paths
    vocab = model.args.vocab_size  # ids outside it would make the embedding read out of bounds
    tokens = sum(int(load_shard(corpus.root / n, vocab).offsets[-1]) for n in forced + relabel)
    tapped = f" with target layers {', '.join(map(str, layers))}" if layers else ""
    log(f"features for {corpus.name}: {len(forced)} shards teacher-forced{tapped}, {len(relabel)} labelled from stored "
        f"states ({tokens} tokens) -> {cache_root}")
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=tokens, desc=f"features {corpus.name}", unit="tok", unit_scale=True, dynamic_ncols=True)
    t0, done = time.perf_counter(), 0
    for n in relabel + forced:
        sh = load_shard(corpus.root / n, vocab)
        if finished(paths[n]) and paths[n].labels.exists():  # built meanwhile by another worker
            if bar is not None:
                bar.update(int(sh.offsets[-1]))
            continue
        if n in relabel:
            hidden = np.load(paths[n].hidden, mmap_mode="r")
            if hidden.shape[0] != context_count(sh):
                raise UserError(f"feature file {paths[n].hidden} does not match its shard: delete it (it is rebuilt "
                                f"on demand)")
            _save_labels(paths[n].labels, *_labels_in_chunks(model, hidden, TOP_K))
            if bar is not None:
                bar.update(int(sh.offsets[-1]))
        else:
            hidden, ids, logp = teacher_forced(model, sh, pad_id, progress=bar.update if bar is not None else None,
                                               layers=layers)
            H = model.args.hidden_size
            _save_labels(paths[n].labels, ids, logp)  # labels and taps first: hidden present means "pass done"
            if paths[n].taps is not None:
                write_atomic(paths[n].taps, _npy_bytes(np.ascontiguousarray(hidden[:, H:])))
            write_atomic(paths[n].hidden, _npy_bytes(np.ascontiguousarray(hidden[:, :H])))
        done += int(sh.offsets[-1])
    if bar is not None:
        bar.close()
    s = time.perf_counter() - t0
    log(f"features for {corpus.name} built in {s:.0f} s ({done / max(s, 1e-9):.0f} tok/s)")
    return paths


@dataclass
class Features:
    """A shard's stored features: hidden (C, H) float16 (memory-mapped), top_ids (C, k), top_logp (C, k), and
    where asked for, the tapped layers' states taps (C, n H) float16 (memory-mapped)."""

    hidden: np.ndarray
    top_ids: np.ndarray
    top_logp: np.ndarray
    taps: np.ndarray | None = None


def load_features(paths: FeaturePaths, shard: Shard) -> Features:
    """A shard's features, checked against its context count; a one-line UserError if they do not fit."""
    try:
        hidden = np.load(paths.hidden, mmap_mode="r")
        with np.load(paths.labels) as z:
            ids, logp = z["top_ids"], z["top_logp"]
        taps = np.load(paths.taps, mmap_mode="r") if paths.taps is not None else None
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"feature files {paths.hidden} / {paths.labels} are unreadable ({type(e).__name__}): delete "
                        f"them (they are rebuilt on demand)") from None
    n = context_count(shard)
    if not hidden.shape[0] == ids.shape[0] == logp.shape[0] == n:
        raise UserError(f"feature file {paths.hidden} has {hidden.shape[0]} states but its shard has {n} context "
                        f"positions: delete it (it is rebuilt on demand)")
    if taps is not None and taps.shape != (n, len(paths.layers) * hidden.shape[1]):
        raise UserError(f"feature file {paths.taps} holds {taps.shape} states where its shard needs "
                        f"{(n, len(paths.layers) * hidden.shape[1])}: delete it (it is rebuilt on demand)")
    return Features(hidden, ids, logp, taps)
