"""Self-distillation data for drafter training: the target writes its own greedy answers.

Prompts are chat-formatted and run in batches (left padding, per-row positions 0..n-1, boolean masks that hide
pad slots). While the target generates, its post-norm hidden state at every position of prompt + response is
captured (no second pass). Each shard of prompts is stored as one `.npz` file in a cache directory:

    tokens (T,) int32       all sequences (prompt + response, eos included) concatenated
    offsets (n+1,) int64    sequence i is tokens[offsets[i]:offsets[i+1]]
    prompt_len (n,) int32   prompt tokens of each sequence
    hidden (T - n, H) f16   hidden state at every position but the last of each sequence, concatenated
    digest ()               hash of the shard's prompts and settings (a shard with another digest is regenerated)

Shards are written to a temp file and renamed, so an interrupted run resumes at the first missing shard.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from .cache import KVCache
from .errors import UserError
from .loader import Target
from .model import Model
from .prompts import read_prompts  # noqa: F401  (re-exported: distill's prompt reader)

DEFAULT_CACHE = Path(".cache/distill")
# Share of each prompt source kept for the default chat-like mix (the pool is 36% math, 22% code).
SOURCE_WEIGHTS = {
    "dolly15k_partial": 1.0, "oasst": 1.0, "gpteacher_roleplay": 1.0, "self_instruct_seed": 1.0,
    "gsm8k_train": 0.08, "gpteacher_codegen": 0.2,
}


def select_prompts(rows: list[dict], n: int | None = None, seed: int = 0,
                   weights: dict[str, float] | None = None) -> list[dict]:
    """Weighted subsample by `source` (unknown sources kept), shuffled with `seed`, first n."""
    weights = SOURCE_WEIGHTS if weights is None else weights
    rng = random.Random(seed)
    kept = [r for r in rows if rng.random() < weights.get(r.get("source", ""), 1.0)]
    rng.shuffle(kept)
    return kept[:n] if n else kept


@dataclass
class Shard:
    """One shard of distillation data (see the module docstring)."""

    tokens: np.ndarray
    offsets: np.ndarray
    prompt_len: np.ndarray
    hidden: np.ndarray

    @property
    def num_sequences(self) -> int:
        return len(self.prompt_len)

    @property
    def response_tokens(self) -> int:
        return int(self.offsets[-1] - self.offsets[0] - self.prompt_len.sum())


def generate_batch(model: Model, prompts: list[list[int]], max_new_tokens: int, eos_ids: list[int],
                   compact_below: float = 0.75) -> list[tuple[list[int], np.ndarray]]:
    """Greedy answers for a batch of prompts. Returns per prompt (prompt + response ids, hidden (len-1, H) f16).

    Left padding with the model's own eos id; pad keys are masked out of every real query (a pad query sees only
    itself so its values stay finite). Rows that finish are dropped from the batch (and the KV cache) once fewer
    than `compact_below` of the rows still run.
    """
    if not eos_ids:
        raise UserError("the target tokenizer has no eos id: cannot pad or stop generations")
    B = len(prompts)
    lens = np.array([len(p) for p in prompts])
    Np = int(lens.max())
    pad = Np - lens
    eos = set(eos_ids)
    tok = np.full((B, Np), eos_ids[0], dtype=np.int32)
    for b, p in enumerate(prompts):
        tok[b, pad[b]:] = p
    cols = np.arange(Np)
    positions = np.maximum(cols[None, :] - pad[:, None], 0)
    real_key = cols[None, :] >= pad[:, None]  # (B, Np)
    causal = cols[None, :] <= cols[:, None]  # (q, k)
    mask = (causal[None] & real_key[:, None, :]) | np.eye(Np, dtype=bool)[None]
    cache = KVCache(len(model.model.layers), Np + max_new_tokens)
    logits, hidden = model(mx.array(tok), cache, mx.array(positions, dtype=mx.int32), mx.array(mask[:, None]),
                           last_only=True)
    cache.advance(Np)
    nxt = mx.argmax(logits[:, -1], axis=-1)
    hid16 = hidden.astype(mx.float16)
    mx.eval(nxt, hid16)
    hid_np = np.array(hid16)
    seqs = [list(p) for p in prompts]
    hids: list[list[np.ndarray]] = [[hid_np[b, pad[b]:]] for b in range(B)]
    rows = list(range(B))  # original index of each batch row
    alive = np.ones(B, dtype=bool)
    pad_mx = mx.array(pad[:, None])
    step = 0
    while True:
        new = nxt.tolist()
        for r, t in zip(rows, new):
            if alive[r]:
                seqs[r].append(t)
                if t in eos or len(seqs[r]) - len(prompts[r]) >= max_new_tokens:
                    alive[r] = False
        live = [i for i, r in enumerate(rows) if alive[r]]
        if not live:
            break
        if len(live) < compact_below * len(rows):
            idx = mx.array(live)
            for i in range(cache.num_layers):
                cache.keys[i] = cache.keys[i][idx]
                cache.values[i] = cache.values[i][idx]
            rows = [rows[i] for i in live]
            nxt, pad_mx = nxt[idx], pad_mx[idx]
        S = cache.offset + 1
        pos = (mx.array([len(seqs[r]) - 1 for r in rows]))[:, None]
        m = (mx.arange(S)[None, :] >= pad_mx)[:, None, None, :]
        logits, hidden = model(nxt[:, None].astype(mx.int32), cache, pos, m)
        cache.advance(1)
        nxt = mx.argmax(logits[:, -1], axis=-1)
        h = hidden[:, 0].astype(mx.float16)
        mx.eval(nxt, h, *cache.state())
        h_np = np.array(h)
        for i, r in enumerate(rows):
            if alive[r]:
                hids[r].append(h_np[i : i + 1])
        step += 1
    out = []
    for r in range(B):
        hcat = np.concatenate(hids[r], axis=0)
        assert hcat.shape[0] == len(seqs[r]) - 1, (hcat.shape, len(seqs[r]))
        out.append((seqs[r], hcat))
    return out


def encode_chat(target: Target, prompt: str) -> list[int]:
    """Chat-formatted token ids of one user prompt."""
    tok = target.tokenizer
    return tok.encode(tok.chat_prompt([{"role": "user", "content": prompt}]))


def _digest(model_name: str, prompts: list[str], max_new_tokens: int, max_prompt_tokens: int) -> str:
    h = hashlib.sha256(f"{model_name}|{max_new_tokens}|{max_prompt_tokens}".encode())
    for p in prompts:
        h.update(b"\0" + p.encode("utf-8"))
    return h.hexdigest()[:16]


def shard_path(cache_dir: Path, index: int) -> Path:
    return cache_dir / f"shard-{index:05d}.npz"


def load_shard(path: Path) -> Shard:
    """Read one shard file."""
    with np.load(path) as z:
        return Shard(tokens=z["tokens"], offsets=z["offsets"], prompt_len=z["prompt_len"], hidden=z["hidden"])


def _shard_digest(path: Path) -> str | None:
    try:
        with np.load(path) as z:
            return str(z["digest"])
    except Exception:
        return None


def _write_shard(path: Path, results: list[tuple[list[int], np.ndarray]], prompt_lens: list[int],
                 digest: str) -> None:
    tokens = np.concatenate([np.array(s, dtype=np.int32) for s, _ in results])
    offsets = np.concatenate([[0], np.cumsum([len(s) for s, _ in results])]).astype(np.int64)
    hidden = np.concatenate([h for _, h in results], axis=0).astype(np.float16)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        np.savez(f, tokens=tokens, offsets=offsets, prompt_len=np.array(prompt_lens, dtype=np.int32),
                 hidden=hidden, digest=np.array(digest))
    os.replace(tmp, path)


def generate_dataset(
    target: Target,
    prompts: list[str],
    cache_dir: str | Path = DEFAULT_CACHE,
    *,
    shard_size: int = 32,
    batch_size: int = 32,
    max_new_tokens: int = 256,
    max_prompt_tokens: int = 384,
    time_budget_s: float | None = None,
    progress: bool = True,
    log: callable = print,
) -> list[Path]:
    """Generate (or reuse) the shards for `prompts`; returns the paths of the finished shards, in order.

    Shard i holds prompts[i*shard_size:(i+1)*shard_size]; a shard file whose digest matches is reused as is.
    Prompts longer than `max_prompt_tokens` tokens are skipped. With `time_budget_s`, generation stops starting
    new shards once that much time has passed (finished shards are kept).
    """
    if not prompts:
        raise UserError("no prompts to distill")
    cache_dir = Path(cache_dir) / target.name
    cache_dir.mkdir(parents=True, exist_ok=True)
    n_shards = (len(prompts) + shard_size - 1) // shard_size
    done: list[Path] = []
    t0 = time.perf_counter()
    generated_tokens = 0
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=n_shards, desc="distill shards", unit="shard", dynamic_ncols=True)
    try:
        for i in range(n_shards):
            chunk = prompts[i * shard_size : (i + 1) * shard_size]
            digest = _digest(target.name, chunk, max_new_tokens, max_prompt_tokens)
            path = shard_path(cache_dir, i)
            if path.exists() and _shard_digest(path) == digest:
                done.append(path)
                if bar:
                    bar.update(1)
                continue
            if time_budget_s is not None and time.perf_counter() - t0 > time_budget_s:
                log(f"time budget reached: stopping after {len(done)} of {n_shards} shards")
                break
            ids = [encode_chat(target, p) for p in chunk]
            ids = [x for x in ids if 0 < len(x) <= max_prompt_tokens]
            if not ids:
                continue
            order = np.argsort([len(x) for x in ids], kind="stable")  # similar lengths batch together
            ids = [ids[j] for j in order]
            results: list[tuple[list[int], np.ndarray]] = []
            for b in range(0, len(ids), batch_size):
                results += generate_batch(target.model, ids[b : b + batch_size], max_new_tokens,
                                          target.tokenizer.eos_ids)
            _write_shard(path, results, [len(x) for x in ids], digest)
            done.append(path)
            generated_tokens += sum(len(s) - len(p) for (s, _), p in zip(results, ids))
            if bar:
                el = time.perf_counter() - t0
                bar.set_postfix(gen_tok=generated_tokens, tok_s=f"{generated_tokens / el:.0f}")
                bar.update(1)
    finally:
        if bar:
            bar.close()
    return done


def iter_shards(paths: list[Path]) -> Iterator[Shard]:
    """Load shards one by one."""
    for p in paths:
        yield load_shard(p)


def write_prompt_subset(rows: list[dict], path: str | Path) -> None:
    """Write prompts as JSONL ({"prompt", "source"})."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps({"prompt": r["prompt"], "source": r.get("source", "")}, ensure_ascii=False) + "\n")
