"""The distillation corpus: the target's own greedy answers to training prompts, stored as token ids.

The corpus lives in the repository (`data/corpus/<model>/`) and grows shard by shard, run after run; nothing
is regenerated. Derived data (hidden states, top-k log-probs) is rebuilt from it on demand (`features.py`).

    manifest.json          what made the corpus: target fingerprint, settings, prompt plan, one entry per shard
    shard-00000.npz        compressed: tokens (T,) uint16|int32, offsets (n+1,), prompt_len (n,),
                           prompt_index (n,) row of the plan, turn (n,) 1 or 2, split "train"|"heldout"

A sequence is prompt + response in the target's chat format; the response ends with the eos token when the
model stopped by itself. Turn-2 shards continue turn-1 sequences with a short generic follow-up request, so
multi-turn contexts are covered. Shard 0 holds the held-out prompts: never trained on, used for evaluation.
Every shard is written to a temp file and renamed, and the manifest records its sha256: an interrupted run
resumes at the first missing shard; a shard that is missing from the manifest, or whose bytes do not match
it, is reported in one line and regenerated.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlx_redrafter.errors import UserError
from mlx_redrafter.files import write_atomic
from mlx_redrafter.model import Model
from mlx_redrafter.models.loader import Target

FORMAT = "redrafter-mlx-corpus/1"
# Order of the prompt pool: a weighted shuffle, so general chat comes first and the pool's math / code share
# (36% gsm8k, 22% codegen) trickles in later; every prompt is eventually used.
SOURCE_WEIGHTS = {"gsm8k_train": 0.15, "gpteacher_codegen": 0.3}
# Licenses of the sources in ../shared/data/train_prompts.jsonl (its README); extra_nc is not used: its
# non-commercial / unclear licenses do not allow redistributing outputs in this Apache-2.0 repository.
LICENSES = {
    "gsm8k_train": "MIT", "dolly15k_partial": "CC-BY-SA-3.0", "gpteacher_codegen": "MIT",
    "gpteacher_roleplay": "MIT", "oasst": "Apache-2.0", "self_instruct_seed": "Apache-2.0",
}
FOLLOW_UPS = [
    "Make that shorter.",
    "Can you expand on that with more detail?",
    "Rewrite your answer as a bulleted list.",
    "Summarize your answer in one sentence.",
    "Explain that to a ten-year-old.",
    "Give me a concrete example.",
    "Rewrite that in a more formal tone.",
    "What is the most important point in your answer?",
    "Now write it again, but friendlier.",
    "Are you sure? Double-check your answer.",
]


@dataclass
class Settings:
    """How sequences are generated (part of every shard's identity)."""

    max_new_tokens: int = 512
    max_prompt_tokens: int = 768  # turn-2 prompts carry the first answer
    shard_size: int = 256  # prompts per shard
    batch_size: int = 64
    heldout: int = 256  # prompts in shard 0, never trained on
    turn2_every: int = 4  # after every 4 turn-1 shards, one turn-2 shard continuing 1/4 of their sequences
    seed: int = 0


@dataclass
class Job:
    """One shard to produce: which prompts (turn 1) or which earlier sequences (turn 2)."""

    index: int
    turn: int
    split: str
    rows: list[int]  # plan rows (turn 1) or plan rows whose turn-1 sequence is continued (turn 2)
    parents: list[int] = field(default_factory=list)  # turn-1 shards the turn-2 sequences come from

    @property
    def name(self) -> str:
        return f"shard-{self.index:05d}.npz"


def plan_order(rows: list[dict], seed: int) -> list[int]:
    """Deterministic order of the prompt pool: weighted shuffle by source (Efraimidis-Spirakis keys)."""
    rng = random.Random(seed)
    keys = [-math.log(1.0 - rng.random()) / SOURCE_WEIGHTS.get(r.get("source", ""), 1.0) for r in rows]
    return sorted(range(len(rows)), key=lambda i: keys[i])


def plan_jobs(n_rows: int, s: Settings) -> list[Job]:
    """All shards of a full corpus over n_rows ordered prompts: held-out shard, turn-1 shards, turn-2 shards."""
    jobs = [Job(0, 1, "heldout", list(range(min(s.heldout, n_rows))))]
    turn1: list[Job] = []
    start = s.heldout
    while start < n_rows:
        job = Job(len(jobs), 1, "train", list(range(start, min(start + s.shard_size, n_rows))))
        jobs.append(job)
        turn1.append(job)
        start += s.shard_size
        if len(turn1) % s.turn2_every == 0:
            group = turn1[-s.turn2_every:]
            picked = [r for j in group for r in j.rows if _hash_unit(f"turn2:{s.seed}:{r}") < 1 / s.turn2_every]
            jobs.append(Job(len(jobs), 2, "train", picked, parents=[j.index for j in group]))
    return jobs


def _hash_unit(text: str) -> float:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") / 2**64


def target_fingerprint(target: Target) -> str:
    """Short hash of the target's config and weights (a corpus is only valid for the target that wrote it)."""
    from mlx.utils import tree_flatten

    h = hashlib.sha256(json.dumps(vars(target.model.args), sort_keys=True, default=str).encode())
    for k, v in sorted(tree_flatten(target.model.parameters()), key=lambda kv: kv[0]):
        h.update(k.encode())
        h.update(np.array(v.astype(mx.float32)[:2].reshape(-1)[:64]).tobytes())  # cheap: first rows of each
    return h.hexdigest()[:16]


# ---------------------------------------------------------------------------------------------------------
# Batched greedy generation (MLX, the runtime's own model and dtype)


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


def generate_greedy(model: Model, prompts: list[list[int]], max_new_tokens: int, eos_ids: list[int],
                    compact_below: float = 0.75, capture: bool = False,
                    ) -> tuple[list[list[int]], list[np.ndarray] | None]:
    """Greedy responses for a batch of prompts (each ends with an eos id if the model stopped by itself), and
    with `capture` the post-norm hidden states (float16) at each response's context positions: the last
    prompt position and every response position but the last (m states for m response tokens).

    Left padding with the model's own eos id (never a real token as padding); each row gets positions
    0..n-1 and a mask hiding its pad slots. Finished rows are dropped from the batch (and its KV cache) once
    fewer than `compact_below` of the rows still run.
    """
    if not eos_ids:
        raise UserError("the target tokenizer has no eos id: cannot pad or stop generations")
    B = len(prompts)
    lens = np.array([len(p) for p in prompts])
    eos = set(eos_ids)
    tok, positions, mask, pad = left_padded(prompts, eos_ids[0])
    n_pad = tok.shape[1]
    cache = model.make_cache(n_pad + max_new_tokens)
    logits, hidden = model(mx.array(tok), cache, mx.array(positions), mx.array(mask), last_only=True)
    cache.advance(n_pad)
    nxt = mx.argmax(logits[:, -1], axis=-1)
    out: list[list[int]] = [[] for _ in range(B)]
    hids: list[list[np.ndarray]] = [[] for _ in range(B)]
    h_last = hidden[:, -1].astype(mx.float16)
    fed, fed_idx = list(range(B)), list(range(B))
    rows = list(range(B))  # original index of each batch row
    pad_mx = mx.array(pad[:, None])
    lens_mx = mx.array(lens[:, None])
    running = [True] * B
    while True:
        if capture:
            mx.eval(nxt, h_last)
            h_np = np.array(h_last)
            for j, r in zip(fed_idx, fed):
                hids[r].append(h_np[j])
        new = nxt.tolist()
        live = []
        for i, (r, t) in enumerate(zip(rows, new)):
            if running[r]:
                out[r].append(t)
                running[r] = t not in eos and len(out[r]) < max_new_tokens
            if running[r]:
                live.append(i)
        if not live:
            break
        step = len(out[rows[live[0]]])  # tokens generated so far by every running row (they move in lockstep)
        fed = [rows[i] for i in live]
        fed_idx = live
        if len(live) < compact_below * len(rows):
            idx = mx.array(live)
            cache.select(idx)
            rows, fed_idx = fed, list(range(len(live)))
            nxt, pad_mx, lens_mx = nxt[idx], pad_mx[idx], lens_mx[idx]
        key_ok = (mx.arange(cache.offset + 1)[None, :] >= pad_mx)[:, None, None, :]
        logits, hidden = model(nxt[:, None].astype(mx.int32), cache, lens_mx + (step - 1), key_ok)  # nxt's position
        cache.advance(1)
        nxt = mx.argmax(logits[:, -1], axis=-1)
        h_last = hidden[:, 0].astype(mx.float16)
    if not capture:
        return out, None
    return out, [np.stack(h[: len(o)]) for h, o in zip(hids, out)]


# ---------------------------------------------------------------------------------------------------------
# Shards and manifest


@dataclass
class Shard:
    """Sequences of one shard (see the module docstring)."""

    tokens: np.ndarray
    offsets: np.ndarray
    prompt_len: np.ndarray
    prompt_index: np.ndarray
    turn: np.ndarray
    split: str

    @property
    def num_sequences(self) -> int:
        return len(self.prompt_len)

    @property
    def response_tokens(self) -> int:
        return int(self.offsets[-1] - self.offsets[0] - self.prompt_len.sum())

    def sequence(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i]:self.offsets[i + 1]]


def shard_bytes(seqs: list[list[int]], prompt_lens: list[int], prompt_index: list[int], turn: int, split: str,
                vocab_size: int) -> bytes:
    """A compressed .npz holding these sequences."""
    import io

    dt = np.uint16 if vocab_size <= 65536 else np.int32
    buf = io.BytesIO()
    np.savez_compressed(
        buf, tokens=np.concatenate([np.zeros(0, dt)] + [np.asarray(s, dtype=dt) for s in seqs]),
        offsets=np.concatenate([[0], np.cumsum([len(s) for s in seqs])]).astype(np.int64),
        prompt_len=np.asarray(prompt_lens, dtype=np.int32), prompt_index=np.asarray(prompt_index, dtype=np.int32),
        turn=np.full(len(seqs), turn, dtype=np.int8), split=np.array(split))
    return buf.getvalue()


def load_shard(path: Path) -> Shard:
    """Read one shard; a one-line UserError if it is unreadable."""
    try:
        with np.load(path) as z:
            return Shard(tokens=z["tokens"].astype(np.int32), offsets=z["offsets"], prompt_len=z["prompt_len"],
                         prompt_index=z["prompt_index"], turn=z["turn"], split=str(z["split"]))
    except Exception as e:
        raise UserError(f"corpus shard {path} is unreadable ({type(e).__name__}): delete it and run "
                        f"`make distill` to regenerate it") from None


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class Corpus:
    """A corpus directory: its manifest and shards."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.manifest_path = self.root / "manifest.json"
        self.manifest: dict[str, Any] = {}
        if self.manifest_path.exists():
            try:
                self.manifest = json.loads(self.manifest_path.read_text())
            except json.JSONDecodeError:
                raise UserError(f"{self.manifest_path} is not valid JSON: restore it from git "
                                f"(git checkout -- {self.manifest_path})") from None
            if self.manifest.get("format") != FORMAT:
                raise UserError(f"{self.manifest_path} is not a {FORMAT} manifest")

    @property
    def entries(self) -> dict[str, dict[str, Any]]:
        return self.manifest.setdefault("shards", {})

    def check(self, name: str) -> str | None:
        """None if shard `name` is present and intact, else why not (missing / unlisted / corrupt)."""
        path = self.root / name
        entry = self.entries.get(name)
        if not path.exists():
            return "missing"
        if entry is None:
            return "not in the manifest (an interrupted write?)"
        if sha256_file(path) != entry["sha256"]:
            return "corrupt (sha256 does not match the manifest)"
        return None

    def shards(self, split: str | None = None) -> list[Path]:
        """Intact shards in order, optionally only one split; corrupt ones are a one-line error."""
        out = []
        for name in sorted(self.entries):
            problem = self.check(name)
            if problem is not None:
                raise UserError(f"corpus shard {self.root / name} is {problem}: run `make distill` to regenerate "
                                f"it (or restore it with git checkout)")
            if split is None or self.entries[name]["split"] == split:
                out.append(self.root / name)
        return out

    def stats(self) -> dict[str, int]:
        e = self.entries.values()
        return {"shards": len(self.entries), "sequences": sum(x["sequences"] for x in e),
                "response_tokens": sum(x["response_tokens"] for x in e),
                "train_response_tokens": sum(x["response_tokens"] for x in e if x["split"] == "train"),
                "prompts": sum(x["sequences"] for x in e if x["turn"] == 1)}

    def write_shard(self, name: str, data: bytes, entry: dict[str, Any]) -> None:
        """Write a shard, then record it in the manifest (locked: several workers may extend one corpus)."""
        import fcntl

        write_atomic(self.root / name, data)
        with open(self.root / ".manifest.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if self.manifest_path.exists():  # entries other workers added meanwhile
                self.manifest["shards"] = {**json.loads(self.manifest_path.read_text()).get("shards", {}),
                                           **self.entries}
            self.entries[name] = {**entry, "sha256": hashlib.sha256(data).hexdigest()}
            self.save()

    def save(self) -> None:
        write_atomic(self.manifest_path, json.dumps(self.manifest, indent=1, sort_keys=True) + "\n")


def answer_table_bytes(corpus: Corpus) -> tuple[bytes, dict[str, Any]]:
    """answers.npz for `draft.lookup.AnswerTable` and its metadata: the response tokens of every train-split
    sequence, each followed by -1 (the held-out shard stays out, so evaluations on it stay fair)."""
    parts, sequences = [], 0
    for path in corpus.shards("train"):
        shard = load_shard(path)
        for i in range(shard.num_sequences):
            parts += [shard.sequence(i)[int(shard.prompt_len[i]) :], np.array([-1])]
            sequences += 1
    if not parts:
        raise UserError(f"{corpus.root} has no train shards: grow it first with `make distill`")
    tokens = np.concatenate(parts).astype(np.int32)
    meta = {"corpus": str(corpus.root.name), "sequences": sequences, "tokens": int((tokens >= 0).sum()),
            "fingerprint": corpus.manifest.get("target_fingerprint"),
            "shards": {p.name: corpus.entries[p.name]["sha256"] for p in corpus.shards("train")}}
    buf = io.BytesIO()
    np.savez_compressed(buf, tokens=tokens, meta=np.array(json.dumps(meta)))
    return buf.getvalue(), meta


def follow_up_suffix(target: Target, text: str) -> list[int]:
    """Token ids that close the assistant's turn-1 answer (after its eos) and open a turn-2 reply to `text`."""
    tok = target.tokenizer
    marker = "\x00ANSWER\x00"
    rendered = tok.chat_prompt([{"role": "user", "content": "q"}, {"role": "assistant", "content": marker},
                                {"role": "user", "content": text}])
    suffix = rendered.split(marker, 1)[1]
    if tok.eos_token and suffix.startswith(tok.eos_token):
        suffix = suffix[len(tok.eos_token):]  # the stored answer already ends with its eos id
    return tok.encode(suffix)


def build(target: Target, prompts_file: str | Path, root: str | Path, settings: Settings | None = None, *,
          max_shards: int | None = None, hours: float | None = None, features_dir: str | Path | None = None,
          worker: tuple[int, int] = (0, 1), progress: bool = True, log: Callable[[str], None] = print) -> Corpus:
    """Extend the corpus at `root` with the next missing shards of the plan; returns the corpus.

    Resumable: finished shards are kept; a corrupt or unlisted shard file is regenerated (and said so).
    `max_shards` / `hours` bound the work of this run (a shard is never cut in the middle). With
    `features_dir`, the hidden states computed while generating are kept there (see features.py). With
    `worker=(i, n)`, this process makes only the shards whose index is i modulo n, so n processes (one per
    core, one BLAS thread each) can extend one corpus together.
    """
    from mlx_redrafter.prompts import read_prompts

    s = settings or Settings()
    rows = read_prompts(prompts_file)
    order = plan_order(rows, s.seed)
    corpus = Corpus(root)
    fp = target_fingerprint(target)
    m = corpus.manifest
    ident = {"format": FORMAT, "model": target.name, "target_fingerprint": fp, "dtype": target.dtype,
             "settings": vars(s), "prompts_file": Path(prompts_file).name,
             "prompts_sha256": sha256_file(Path(prompts_file))}
    if m:
        for k in ("model", "target_fingerprint", "dtype", "settings", "prompts_sha256"):
            if m.get(k) != ident[k]:
                raise UserError(f"corpus {corpus.root} was made with another {k} ({m.get(k)!r} vs {ident[k]!r}): "
                                f"use another --corpus directory")
    else:
        m.update(ident)
        m["engine"] = "MLX batched greedy, the runtime's own model (mlx_redrafter.train.corpus.generate_greedy)"
        m["licenses"] = LICENSES
    jobs = [j for j in plan_jobs(len(order), s) if j.index % worker[1] == worker[0]]
    todo = []
    for job in jobs:
        problem = corpus.check(job.name)
        if problem is None:
            continue
        if problem != "missing":
            log(f"{corpus.root / job.name} is {problem}: regenerating it")
            corpus.entries.pop(job.name, None)
        todo.append(job)
    if max_shards is not None:
        todo = todo[:max_shards]
    tok = target.tokenizer
    follow_ids = [follow_up_suffix(target, t) for t in FOLLOW_UPS]
    total_prompts = sum(len(j.rows) for j in todo)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total_prompts, desc="distill", unit="prompt", dynamic_ncols=True, smoothing=0.05)
    t_run = time.perf_counter()
    made_tokens = 0
    try:
        for job in todo:
            if hours is not None and time.perf_counter() - t_run > hours * 3600:
                log(f"time budget of {hours} h reached: stopping before {job.name}")
                break
            t0 = time.perf_counter()
            if job.turn == 2 and any(corpus.check(f"shard-{p:05d}.npz") for p in job.parents):
                log(f"{job.name}: its turn-1 shards are not all there yet (another worker?): skipped for now")
                continue
            if job.turn == 1:
                ids = [tok.encode_chat([{"role": "user", "content": rows[order[r]]["prompt"]}])
                       for r in job.rows]
            else:
                ids = _turn2_prompts(corpus, job, follow_ids, set(tok.eos_ids), s)
            keep = [i for i, x in enumerate(ids) if x is not None and 0 < len(x) <= s.max_prompt_tokens]
            prompts = [ids[i] for i in keep]
            index = [job.rows[i] for i in keep]
            by_len = np.argsort([len(p) for p in prompts], kind="stable")  # similar lengths batch together
            responses: dict[int, list[int]] = {}
            hiddens: dict[int, np.ndarray] = {}
            for b in range(0, len(by_len), s.batch_size):
                part = [int(i) for i in by_len[b:b + s.batch_size]]
                outs, hid = generate_greedy(target.model, [prompts[i] for i in part], s.max_new_tokens,
                                            tok.eos_ids, capture=features_dir is not None)
                for k, (i, o) in enumerate(zip(part, outs)):
                    responses[i] = o
                    if hid is not None:
                        hiddens[i] = hid[k]
                n_new = sum(len(o) for o in outs)
                made_tokens += n_new
                if bar is not None:
                    bar.update(len(part))
                    el = time.perf_counter() - t_run
                    bar.set_postfix_str(f"{job.name} {made_tokens / el:.0f} tok/s, {made_tokens} new tokens")
            seqs = [prompts[i] + responses[i] for i in range(len(prompts))]
            data = shard_bytes(seqs, [len(p) for p in prompts], index, job.turn, job.split,
                               target.model.args.vocab_size)
            if features_dir is not None:  # derived data, local: the hidden states generation computed anyway
                from mlx_redrafter.train.features import feature_path, save_features

                save_features(feature_path(features_dir, job.name, hashlib.sha256(data).hexdigest()),
                              [hiddens[i] for i in range(len(prompts))])
            resp = sum(len(r) for r in responses.values())
            sources = Counter(rows[order[r]].get("source", "") for r in index)
            corpus.write_shard(job.name, data, {
                "turn": job.turn, "split": job.split, "sequences": len(seqs), "response_tokens": resp,
                "plan_rows": [job.rows[0], job.rows[-1]] if job.rows else [], "parents": job.parents,
                "skipped_prompts": len(job.rows) - len(keep), "sources": dict(sorted(sources.items())),
                "eos_stops": sum(1 for r in responses.values() if r and r[-1] in tok.eos_ids),
                "seconds": round(time.perf_counter() - t0, 1),
                "new_tokens_per_s": round(resp / max(time.perf_counter() - t0, 1e-9), 1),
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            })
            if bar is not None:
                bar.update(len(job.rows) - len(keep))
            log(f"{job.name}: turn {job.turn} {job.split}, {len(seqs)} sequences, {resp} response tokens, "
                f"{time.perf_counter() - t0:.0f} s ({resp / max(time.perf_counter() - t0, 1e-9):.0f} tok/s); "
                f"corpus {corpus.stats()['response_tokens']} response tokens")
    finally:
        if bar is not None:
            bar.close()
    return corpus


def _turn2_prompts(corpus: Corpus, job: Job, follow_ids: list[list[int]], eos: set[int],
                   s: Settings) -> list[list[int] | None]:
    """Turn-2 prompts: the turn-1 sequence of each picked row + a follow-up; None where the first answer did
    not end with eos (cut at max_new_tokens) or is missing."""
    by_row: dict[int, np.ndarray] = {}
    for parent in job.parents:
        name = f"shard-{parent:05d}.npz"
        problem = corpus.check(name)
        if problem is not None:
            raise UserError(f"turn-2 {job.name} needs {corpus.root / name}, which is {problem}")
        sh = load_shard(corpus.root / name)
        for i, r in enumerate(sh.prompt_index.tolist()):
            seq = sh.sequence(i)
            if len(seq) > sh.prompt_len[i] and int(seq[-1]) in eos:
                by_row[r] = seq
    out: list[list[int] | None] = []
    for r in job.rows:
        seq = by_row.get(r)
        if seq is None:
            out.append(None)
            continue
        follow = follow_ids[int(_hash_unit(f"follow:{s.seed}:{r}") * len(follow_ids))]
        out.append(seq.tolist() + follow)
    return out
