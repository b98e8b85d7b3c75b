"""The corpus format: token sequences for drafter training, stored as compressed shards plus a manifest.

A corpus lives in the repository (`data/corpus/<name>/`) and grows shard by shard, run after run; nothing is
regenerated. Its sequences come from one source (`train/distill.py`): the target's own greedy answers, fixed
public text, or an OpenAI-compatible endpoint. Derived data (the target's hidden states and top-k labels) is
rebuilt from the token ids on demand (`features.py`).

    manifest.json          what made the corpus: source, target fingerprint, settings, one entry per shard
    shard-00000.npz        compressed: tokens (T,) uint16|int32, offsets (n+1,), prompt_len (n,),
                           prompt_index (n,) row of the source, turn (n,) 1 or 2, split "train"|"heldout"

A sequence is prompt + response in the target's chat format; a response ends with the eos token when it ended
by itself. Every shard is written to a temp file and renamed, and the manifest records its sha256, so an
interrupted run resumes at the first missing shard and a shard whose bytes do not match is regenerated.
Several worker processes may extend one corpus: manifest updates are merged entry by entry under a lock, and
a worker never replaces a newer entry with an older one.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlx_redrafter.errors import UserError
from mlx_redrafter.files import read_json, write_atomic
from mlx_redrafter.schema import Field, check_fields, shown
from mlx_redrafter.token_ids import check_id_array

FORMAT = "redrafter-mlx-corpus/1"
# Identity keys a manifest may lack because it predates them: corpora made before sources were recorded hold the
# target's greedy answers.
IDENTITY_DEFAULTS = {"source": "greedy"}


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


def shard_bytes(seqs: list[list[int]], prompt_lens: list[int], prompt_index: list[int], turn: int | list[int],
                split: str, vocab_size: int) -> bytes:
    """A compressed .npz holding these sequences."""
    dt = np.uint16 if vocab_size <= 65536 else np.int32
    buf = io.BytesIO()
    turns = np.full(len(seqs), turn, dtype=np.int8) if isinstance(turn, int) else np.asarray(turn, dtype=np.int8)
    np.savez_compressed(
        buf, tokens=np.concatenate([np.zeros(0, dt)] + [np.asarray(s, dtype=dt) for s in seqs]),
        offsets=np.concatenate([[0], np.cumsum([len(s) for s in seqs])]).astype(np.int64),
        prompt_len=np.asarray(prompt_lens, dtype=np.int32), prompt_index=np.asarray(prompt_index, dtype=np.int32),
        turn=turns, split=np.array(split))
    return buf.getvalue()


def load_shard(path: Path, vocab_size: int | None = None) -> Shard:
    """Read one shard; a one-line UserError if it is unreadable or inconsistent, or (given the target's
    `vocab_size`) holds a token id outside its vocabulary, which the target's embedding would read out of bounds."""
    try:
        with np.load(path) as z:
            shard = Shard(tokens=z["tokens"].astype(np.int32), offsets=z["offsets"], prompt_len=z["prompt_len"],
                          prompt_index=z["prompt_index"], turn=z["turn"], split=str(z["split"]))
    except Exception as e:
        raise UserError(f"corpus shard {path} is unreadable ({type(e).__name__}): delete it and run "
                        f"`make distill` to regenerate it") from None
    n = len(shard.prompt_len)
    lens = np.diff(shard.offsets) if len(shard.offsets) == n + 1 else None
    if (lens is None or shard.offsets[0] != 0 or shard.offsets[-1] != len(shard.tokens) or (lens < 1).any()
            or (shard.prompt_len < 1).any() or (shard.prompt_len > lens).any()):
        raise UserError(f"corpus shard {path} has inconsistent offsets: delete it and run `make distill` to "
                        f"regenerate it")
    if vocab_size is not None:
        try:
            check_id_array(mx.array(shard.tokens), vocab_size, f"corpus shard {path}")
        except UserError as e:
            raise UserError(f"{e} of the target: it was made for another model, or is corrupt; use that model's "
                            f"corpus, or delete the shard and run `make distill` to regenerate it") from None
    return shard


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# What every shard entry of a manifest holds (more keys are kept as they are: timings, sources, plan rows...).
SHARD_FIELDS = (
    Field("sha256", str, required=True),
    Field("split", str, required=True, choices=("train", "heldout")),
    Field("sequences", int, 0, None, required=True),
    Field("response_tokens", int, 0, None, required=True),
    Field("turn", int, required=True, choices=(1, 2)),
    Field("created_unix", float, 0, None),
    Field("created", str),
)
SHARD_NAME = re.compile(r"\w[\w.-]*\.npz")  # a file in the corpus folder, never a path out of it


def shard_index(name: str) -> int | None:
    """The plan index in a shard's file name (shard-00012.npz -> 12); None for a name without one."""
    m = re.search(r"(\d+)\.npz$", name)
    return int(m.group(1)) if m else None


def _read_manifest(path: Path) -> dict[str, Any]:
    """A corpus manifest, its layout and every shard entry checked (`SHARD_FIELDS`); one-line errors that say to
    restore it."""
    manifest = read_json(path, "corpus manifest")
    restore = f"restore it from git (git checkout -- {path})"
    if manifest.get("format") != FORMAT:
        raise UserError(f"{path} is not a {FORMAT} manifest: {restore}")
    if not isinstance(manifest.setdefault("shards", {}), dict):
        raise UserError(f"{path}: 'shards' is not an object: {restore}")
    for name, entry in manifest["shards"].items():
        if not SHARD_NAME.fullmatch(name):
            raise UserError(f"corpus manifest {path} lists {shown(name)}, not a shard file name (shard-NNNNN.npz): "
                            f"{restore}")
        try:
            check_fields(entry, SHARD_FIELDS, f"corpus manifest {path}, shard {name}")
        except UserError as e:
            raise UserError(f"{e}: {restore}") from None
    return manifest


def entry_time(entry: dict[str, Any]) -> float:
    """When a manifest entry was written (seconds since the epoch; 0 if unknown)."""
    if "created_unix" in entry:
        return float(entry["created_unix"])
    try:
        return time.mktime(time.strptime(entry.get("created", ""), "%Y-%m-%dT%H:%M:%S%z"))
    except (TypeError, ValueError):
        return 0.0


def merge_entries(disk: dict[str, dict], mine: dict[str, dict]) -> dict[str, dict]:
    """Shard entries of two manifest versions, entry by entry: the newer entry of each shard wins (disk on ties)."""
    out = dict(disk)
    for name, entry in mine.items():
        if name not in out or entry_time(entry) > entry_time(out[name]):
            out[name] = entry
    return out


class Corpus:
    """A corpus directory: its manifest and shards; with the target's `vocab_size`, shards read by `shard` are
    checked against its vocabulary."""

    def __init__(self, root: str | Path, vocab_size: int | None = None):
        self.root = Path(root)
        self.vocab_size = vocab_size
        self.manifest_path = self.root / "manifest.json"
        self.manifest: dict[str, Any] = _read_manifest(self.manifest_path) if self.manifest_path.exists() else {}

    @property
    def name(self) -> str:
        return self.root.name

    @property
    def entries(self) -> dict[str, dict[str, Any]]:
        return self.manifest.setdefault("shards", {})

    def claim(self, identity: dict[str, Any], checked: tuple[str, ...]) -> None:
        """Record what makes this corpus (a new one), or check that `identity` matches it on the `checked` keys."""
        m = self.manifest
        if not m.get("shards"):
            m.update(identity)
            return
        for k in checked:
            have = m.get(k, IDENTITY_DEFAULTS.get(k))
            if have != identity.get(k):
                raise UserError(f"corpus {self.root} was made with another {k} ({have!r} vs {identity.get(k)!r}): "
                                f"use another --corpus directory")

    def shard(self, name: str) -> Shard:
        """Shard `name` read by `load_shard` (its ids checked when the corpus knows the target's vocabulary)."""
        return load_shard(self.root / name, self.vocab_size)

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
        """Write a shard, then record it in the manifest (merged with what other workers recorded meanwhile)."""
        write_atomic(self.root / name, data)
        now = time.time()
        fresh = {**entry, "sha256": hashlib.sha256(data).hexdigest(), "created_unix": round(now, 6),
                 "created": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(now))}
        self.update({name: fresh})

    def update(self, entries: dict[str, dict[str, Any]]) -> None:
        """Merge `entries` into the manifest on disk under the corpus lock and save it."""
        import fcntl

        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".manifest.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            disk = _read_manifest(self.manifest_path) if self.manifest_path.exists() else {}
            merged = merge_entries(merge_entries(disk.get("shards", {}), self.entries), entries)
            self.manifest = {**disk, **{k: v for k, v in self.manifest.items() if k != "shards"}, "shards": merged}
            write_atomic(self.manifest_path, json.dumps(self.manifest, indent=1, sort_keys=True) + "\n")


def answer_table_bytes(corpus: Corpus) -> tuple[bytes, dict[str, Any]]:
    """answers.npz for `draft.lookup.AnswerTable` and its metadata: the response tokens of every train-split
    sequence, each followed by -1 (the held-out shard stays out, so evaluations on it stay fair)."""
    parts, sequences = [], 0
    for path in corpus.shards("train"):
        shard = corpus.shard(path.name)
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
