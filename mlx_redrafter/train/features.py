"""Derived training data: the target's post-norm hidden state at every context position of the corpus.

A context position of a sequence (prompt length P, n tokens) is p = P-1 .. n-2: the drafter learns to predict
tokens p+1.. from the hidden state h_p. One float16 array (contexts, H) per shard lives in a local cache,
`<cache>/<model>/shard-XXXXX-<sha12>.npy`, keyed by the shard's sha256 (a regenerated shard never meets stale
features). The data engine stores the states it computed while generating; anything missing is rebuilt by a
teacher-forced float32 pass of the runtime's own model (`teacher_forced`).
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_redrafter.files import write_atomic
from mlx_redrafter.model import Model
from mlx_redrafter.train.corpus import Corpus, Shard, left_padded, load_shard

DEFAULT_CACHE = Path(".cache/features")


def feature_path(root: str | Path, shard_name: str, sha256: str) -> Path:
    return Path(root) / f"{Path(shard_name).stem}-{sha256[:12]}.npy"


def save_features(path: Path, per_sequence: list[np.ndarray]) -> None:
    """Concatenate per-sequence (m_i, H) states and write them atomically as one .npy (float16)."""
    H = next((h.shape[1] for h in per_sequence if h.ndim == 2), 0)
    arr = np.concatenate([np.zeros((0, H), np.float16)] + [h.astype(np.float16) for h in per_sequence])
    buf = io.BytesIO()
    np.save(buf, arr)
    write_atomic(path, buf.getvalue())


def context_count(shard: Shard) -> int:
    return int((shard.offsets[1:] - shard.offsets[:-1] - shard.prompt_len).sum())


def teacher_forced(model: Model, shard: Shard, pad_id: int, max_batch_tokens: int = 4096) -> np.ndarray:
    """Hidden states (float16) at every context position of the shard, in sequence order (float32 forward)."""
    n_seq = shard.num_sequences
    lens = shard.offsets[1:] - shard.offsets[:-1]
    out: list[np.ndarray | None] = [None] * n_seq
    order = np.argsort(lens, kind="stable")
    i = 0
    while i < n_seq:
        j = i + 1
        while j < n_seq and (j - i + 1) * lens[order[j]] <= max_batch_tokens:
            j += 1
        idx = order[i:j]
        seqs = [shard.sequence(k).tolist() for k in idx]
        tok, pos, mask, pad = left_padded(seqs, pad_id)
        _, hidden = model(mx.array(tok), model.make_cache(tok.shape[1]), mx.array(pos), mx.array(mask),
                          last_only=True)
        h = np.array(hidden.astype(mx.float16))
        for b, k in enumerate(idx):
            P, n = int(shard.prompt_len[k]), int(lens[k])
            out[k] = h[b, pad[b] + P - 1 : pad[b] + n - 1]
        i = j
    H = model.args.hidden_size
    return np.concatenate([np.zeros((0, H), np.float16)] + out)


def ensure(corpus: Corpus, model: Model, pad_id: int, cache_root: str | Path, names: list[str] | None = None,
           progress: bool = True, log: Callable[[str], None] = print) -> dict[str, Path]:
    """Feature files for the corpus shards `names` (default: all), rebuilding the missing ones."""
    names = names or sorted(corpus.entries)
    paths = {n: feature_path(cache_root, n, corpus.entries[n]["sha256"]) for n in names}
    missing = [n for n in names if not paths[n].exists()]
    if missing:
        tokens = sum(int(load_shard(corpus.root / n).offsets[-1]) for n in missing)
        log(f"building features for {len(missing)} shards ({tokens} tokens, teacher-forced float32) -> {cache_root}")
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=tokens, desc="features", unit="tok", unit_scale=True, dynamic_ncols=True)
        t0 = time.perf_counter()
        for n in missing:
            sh = load_shard(corpus.root / n)
            arr = teacher_forced(model, sh, pad_id)
            buf = io.BytesIO()
            np.save(buf, arr)
            write_atomic(paths[n], buf.getvalue())
            if bar is not None:
                bar.update(int(sh.offsets[-1]))
        if bar is not None:
            bar.close()
        log(f"features built in {time.perf_counter() - t0:.0f} s")
    return paths


def load_features(path: Path, shard: Shard) -> np.ndarray:
    """The (contexts, H) float16 states of a shard; checked against the shard's context count."""
    arr = np.load(path, mmap_mode="r")
    if arr.shape[0] != context_count(shard):
        from mlx_redrafter.errors import UserError

        raise UserError(f"feature file {path} has {arr.shape[0]} states but its shard has {context_count(shard)} "
                        f"context positions: delete it (it is rebuilt on demand)")
    return arr
