"""Acceptance by replay: how many tokens per target call draft sources would decide, without running the target.

Greedy decoding is deterministic, so on a sequence the target generated greedily (a corpus sequence) a
candidate is accepted exactly as far as it matches the sequence itself, and the target's hidden state at
every position is the one stored in the features. Replaying the decode loop over stored sequences therefore
gives the tokens per target call of greedy speculative decoding (up to float noise between the batched pass
that stored the states and a one-sequence decode) at the cost of drafting alone. Used to tune draft sources
and to compare drafters quickly; the real decode (`eval-drafter`, the bench) confirms. `greedy_answers` makes such
sequences from any prompts (the runtime's own answers and one teacher-forced forward for the states, tapped layers
included), which is what `eval-drafter --replay` replays.
"""

from __future__ import annotations

import hashlib
import io
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_redrafter.draft.base import Allocator, DecodeState, propose
from mlx_redrafter.train.corpus import Shard


@dataclass
class ReplayStats:
    """Counters of a replay (same conventions as generate.Stats)."""

    steps: int = 0
    decided: int = 0  # tokens decided after each sequence's first one
    accepted_hist: Counter = field(default_factory=Counter)
    source_runs: Counter = field(default_factory=Counter)
    verified: int = 0  # candidate slots that would be packed (upper bound: before prefix sharing)

    @property
    def tokens_per_step(self) -> float:
        return self.decided / self.steps if self.steps else 0.0

    def as_dict(self) -> dict:
        return {"steps": self.steps, "tokens_per_step": round(self.tokens_per_step, 4),
                "source_tokens_per_step": {k: round(1 + v / max(self.steps, 1), 4)
                                           for k, v in self.source_runs.items()},
                "accepted_hist": {str(k): v for k, v in sorted(self.accepted_hist.items())},
                "candidate_slots_per_step": round(self.verified / max(self.steps, 1), 2)}


def replay_sequence(tokens: np.ndarray, prompt_len: int, hidden: np.ndarray, make_allocator, length: int,
                    max_tokens: int, stats: ReplayStats) -> None:
    """Replay one sequence: `hidden` (contexts, H) are the states at positions prompt_len-1 .. n-2."""
    x = tokens.tolist()
    end = min(len(x), prompt_len + max_tokens)  # the response's first max_tokens tokens
    alloc: Allocator = make_allocator()
    p = prompt_len - 1  # position of the last token in the cache; x[p + 1] is g0
    state = DecodeState(tokens=x[: p + 2], g0=mx.array([x[p + 1]], dtype=mx.int32),
                        h=mx.array(hidden[0:1].astype(np.float32)))
    for src in alloc.sources:
        src.start(state.tokens)
    while p + 2 < end:
        truth = x[p + 2 : end]
        proposal = propose(alloc.plan(), state, length)
        runs, best = {}, 0
        if proposal.rows:  # else nothing was proposed: an autoregressive step
            cands = np.array(proposal.candidates)
            stats.verified += int((cands >= 0).sum())
            matched = []
            for row in cands:
                k = 0
                while k < len(row) - 1 and k < len(truth) and row[k + 1] == truth[k]:
                    k += 1
                matched.append(k)
            runs, best = proposal.by_source(matched), max(matched)
        alloc.update(runs)
        stats.source_runs.update(runs)
        stats.steps += 1
        stats.accepted_hist[best] += 1
        new = x[p + 2 : min(p + 3 + best, end)]  # accepted drafts and the target's next token
        stats.decided += len(new)
        p += len(new)
        if p + 1 >= end:
            break
        state.tokens.extend(new)
        state.g0 = mx.array([x[p + 1]], dtype=mx.int32)
        state.h = mx.array(hidden[p - prompt_len + 1 : p - prompt_len + 2].astype(np.float32))
        for src in alloc.sources:
            src.extend(new)


def replay(shard: Shard, hidden: np.ndarray, make_allocator, length: int, max_tokens: int = 128,
           sequences: list[int] | None = None, turn: int | None = 1) -> ReplayStats:
    """Replay the given sequences of a shard (default: all turn-1 ones) with fresh sources each."""
    stats = ReplayStats()
    counts = (shard.offsets[1:] - shard.offsets[:-1] - shard.prompt_len).astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(counts)])
    idx = sequences if sequences is not None else [i for i in range(shard.num_sequences)
                                                   if turn is None or shard.turn[i] == turn]
    for i in idx:
        P = int(shard.prompt_len[i])
        replay_sequence(shard.sequence(i), P, hidden[starts[i] : starts[i + 1]], make_allocator, length, max_tokens,
                        stats)
    return stats


@dataclass
class Answer:
    """A prompt's greedy answer by the runtime and the target's features along it: what replaying it needs."""

    tokens: np.ndarray  # prompt + answer
    prompt_len: int
    hidden: np.ndarray  # (answer tokens, F) float32: the features at positions prompt_len - 1 .. n - 2


ANSWERS_FORMAT = 1  # of the files `greedy_answers` keeps


def greedy_answers(lm, prompts: list[list[int]], max_tokens: int, log=None,
                   cache_dir: str | Path | None = None) -> list[Answer]:
    """Each prompt's greedy answer (the runtime's plain decoding, float32) and the features the loaded drafter
    reads along it (tapped layers included), from one teacher-forced forward over prompt + answer. `log`, if
    given, receives a progress line with an ETA now and then. With `cache_dir`, the answers are kept there, one file
    per target (its fingerprint), tapped layers, prompts and answer length, and read back instead of decoded again."""
    from mlx_redrafter import api
    from mlx_redrafter.files import write_atomic
    from mlx_redrafter.model import forward_chunked
    from mlx_redrafter.train.distill import target_fingerprint

    model = lm.target.model
    path = None
    if cache_dir is not None:
        key = json.dumps({"format": ANSWERS_FORMAT, "target": target_fingerprint(lm.target), "max_tokens": max_tokens,
                          "layers": list(model.feature_layers), "prompts": [list(map(int, p)) for p in prompts]})
        path = Path(cache_dir) / f"answers-{hashlib.sha256(key.encode()).hexdigest()[:16]}.npz"
        kept = _read_answers(path, len(prompts))
        if kept is not None:
            return kept
    out, t0 = [], time.perf_counter()
    options = api.decode_options(draft="none", max_tokens=max_tokens)
    for i, ids in enumerate(prompts):
        seq = list(ids) + api.generate(lm, list(ids), options).tokens
        cache = model.make_cache(len(seq))
        _, hidden = forward_chunked(model, cache, mx.array([seq]), all_hidden=True)
        h = hidden[0, len(ids) - 1 : len(seq) - 1].astype(mx.float32)
        out.append(Answer(np.array(seq, dtype=np.int32), len(ids), np.array(h)))
        done = i + 1
        if log is not None and (done % 10 == 0 or done == len(prompts)):
            spent = time.perf_counter() - t0
            log(f"greedy answers to replay: {done}/{len(prompts)}, ETA {spent / done * (len(prompts) - done):.0f} s")
    if path is not None:
        buf = io.BytesIO()
        np.savez(buf, tokens=np.concatenate([a.tokens for a in out]), prompt_len=[a.prompt_len for a in out],
                 lengths=[len(a.tokens) for a in out], hidden=np.concatenate([a.hidden for a in out]))
        write_atomic(path, buf.getvalue())
    return out


def _read_answers(path: Path, count: int) -> list[Answer] | None:
    """The answers a `greedy_answers` file keeps (None where it is missing or does not read as `count` of them)."""
    try:
        with np.load(path) as z:
            tokens, plen, lens, hidden = z["tokens"], z["prompt_len"], z["lengths"], z["hidden"]
    except (OSError, ValueError, KeyError, EOFError):
        return None
    if len(lens) != count or int(lens.sum()) != len(tokens) or int((lens - plen).sum()) != len(hidden):
        return None
    t_end, h_end = np.cumsum(lens), np.cumsum(lens - plen)
    return [Answer(tokens[t - n : t], int(p), hidden[h - (n - p) : h])
            for n, p, t, h in zip(lens.tolist(), plen.tolist(), t_end.tolist(), h_end.tolist())]


def replay_answers(answers: list[Answer], make_allocator, length: int, max_tokens: int) -> list[ReplayStats]:
    """Replay each answer with fresh sources (`make_allocator()`), candidates of `length` tokens: one
    `ReplayStats` per answer."""
    stats = []
    for a in answers:
        st = ReplayStats()
        replay_sequence(a.tokens, a.prompt_len, a.hidden, make_allocator, length, max_tokens, st)
        stats.append(st)
    return stats
