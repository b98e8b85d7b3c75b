"""Self-distillation and drafter training on a CUDA machine, in PyTorch: what this project's CPU cannot reach.

Three steps; only `run` needs a GPU, and it imports neither MLX nor `mlx_redrafter` (torch, transformers, gguf,
numpy and safetensors only):

    python -m bench.torch_ref.cuda_job prepare --job .gpu        here: prompts still missing from the greedy corpus,
                                                                  the turn-2 recipe, parity prompts, the GGUF in parts,
                                                                  the corpora packed (xz)
    python3 -m bench.torch_ref.cuda_job run --job .gpu --out DIR --budget-s 450      there (CUDA)
    python -m bench.torch_ref.cuda_job land DIR                  here: shards through the corpus' own code (manifest
                                                                  entries say which engine made them), drafters as
                                                                  MLX drafter folders under runs/cuda/

`run` does, within its time budget: (1) CUDA parity: greedy ids and top-5 logits of the MT-bench prompts, for
comparison with MLX here; (2) the target's greedy answers (float32, TF32 off) to every missing turn-1 prompt of the
plan, then to its turn-2 prompts (each a turn-1 sequence + a follow-up, rebuilt there from the corpus' turn-1
shards, which travel packed beside the job: `pack_corpus`), on a continuous batch over a slot KV cache (`slots.py`);
(3) unless `--generate-only`, one teacher-forced pass over every train and held-out sequence (hidden states at draft
starts + the target's top-8 labels at every context position, as `train/features.py` does; float32 unless
`--feature-tf32`), and over the fixed-text corpus where a variant asks for it; (4) warm-started drafters trained
side by side until the budget ends, one per variant of `VARIANTS` (labels, data, shape), with held-out top-1
accuracy per draft step (the same measure as `train/loop.py`'s `evaluate`) and the replayed tokens per call of the
drafter alone on the held-out first turns (`replay_rate`, as `train/replay.py`) before, at checkpoints and after.
"""

from __future__ import annotations

import argparse
import json
import math
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

PART_BYTES = 15 * 2**20  # drafters come back in parts no larger: some transports cap files
GGUF_PART_BYTES = 12 * 2**20  # the GGUF travels (xz) in parts this large: one part and the checkout make one transfer
TOP_K = 8  # labels kept per context position (train/features.py)
EVAL_POSITIONS = 4096  # held-out context positions evaluated (train/loop.py)
ENGINE = ("PyTorch CUDA float32 (transformers LlamaForCausalLM from the same GGUF, TF32 off), "
          "bench/torch_ref/cuda_job.py")
GEN_ENGINE = ("PyTorch CUDA float32 (transformers LlamaForCausalLM's layers from the same GGUF, continuous batching "
              "over a slot KV cache, TF32 off), bench/torch_ref/slots.py")


@dataclass(frozen=True)
class Variant:
    """One drafter of a run: its labels, its data, and how its shape grows from the starting weights."""

    labels: str  # "hard": the target's top-1; "soft": its top-8 renormalized within the head
    text: bool = False  # also train on the fixed-text corpus (teacher-forced; the target's labels, never the text's)
    extra_layers: int = 0  # ResBlocks appended before the head, each starting as the identity
    taps: tuple[int, ...] = ()  # target layers whose (RMS-normalized) outputs are fused with the last state
    head_rows: int = 0  # grow the head to this many rows by the tokens the target decides most (draft/head_rows.py)
    noise: float = 0.0  # training only: U(-noise, noise) added to the target's states the drafter reads (EAGLE: 0.1)


VARIANTS = {
    "hard": Variant("hard"),
    "soft": Variant("soft"),
    "soft-text": Variant("soft", text=True),
    "soft-deep": Variant("soft", extra_layers=2),
    "soft-fuse": Variant("soft", taps=(2, 15)),  # EAGLE-3's low, middle and high layers
    "soft-fuse3": Variant("soft", taps=(2, 15, 24)),
    # the head chosen in round 1 covers ~94% of today's corpus decisions; 16,384 rows of it cover ~99.4%
    "soft-fuse3-wide": Variant("soft", taps=(2, 15, 24), head_rows=16384),
    # run 8's held-out loss rose from step 2,000 while its training loss fell to a third of it: a regulariser
    "soft-fuse3-wide-noise": Variant("soft", taps=(2, 15, 24), head_rows=16384, noise=0.1),
}


# ----------------------------------------------------------------------------------------------------------- here
def prepare(job_dir: Path, prompts_file: Path, corpus_dir: Path, num_parity: int = 16, from_end: bool = False,
            max_shards: int | None = None, text_corpus: Path | None = None, write_gguf: bool = True,
            pack_corpora: bool = True, self_corpora: list[Path] = ()) -> None:
    """Write the job spec (`job.json`, `job.npz`), the target's GGUF (xz, in parts) and, with `pack_corpora`, the
    corpora (`pack_corpus`) into `job_dir`; `from_end`: the plan's last shards first (the CPU's data job works from
    the front, so the two do not make the same shard); `max_shards`: at most that many shards in the job (a smaller
    job.npz); `self_corpora`: the target's answers to prompts it wrote itself, those with a manifest packed too, all
    in one pack (a run trains on them first)."""
    from mlx_redrafter.errors import UserError
    from mlx_redrafter.models.loader import load_target
    from mlx_redrafter.prompts import first_turns
    from mlx_redrafter.train.corpus import Corpus
    from mlx_redrafter.train.greedy import GreedySource

    target = load_target(None)
    tok = target.tokenizer
    src = GreedySource(target, prompts_file)
    s = src.settings
    corpus = Corpus(corpus_dir, target.model.args.vocab_size)
    todo = [j for j in src.jobs() if corpus.check(j.name) is not None]
    if from_end:
        todo = todo[::-1]
    todo = todo[:max_shards]
    t1_job, t1_row, t1_ids, t2_job, t2_row, t2_follow, t2_column = [], [], [], [], [], [], []
    parents: set[int] = set()
    columns: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}  # sibling passes over the same sequences
    for job in todo:
        if job.turn == 1:
            for r in job.rows:
                ids = tok.encode_chat([{"role": "user", "content": src.rows[src.order[r]]["prompt"]}])
                if 0 < len(ids) <= s.max_prompt_tokens:
                    t1_job.append(job.index)
                    t1_row.append(r)
                    t1_ids.append(ids)
        else:
            parents |= set(job.parents)
            column = columns.setdefault((tuple(job.parents), tuple(job.rows)), len(columns))
            for r in job.rows:
                t2_job.append(job.index)
                t2_row.append(r)
                t2_follow.append(src.follow_choice(r, job.follow_pass))
                t2_column.append(column)
    # a turn-2 prompt is its turn-1 sequence + a follow-up: there, from the corpus (which travels with the checkout)
    # or from the run's own turn-1 answers
    missing = [p for p in sorted(parents) if corpus.check(f"shard-{p:05d}.npz") is not None
               and p not in {j.index for j in todo}]
    if missing:
        raise UserError(f"turn-2 shards of the job need turn-1 shards {missing}, which are neither in "
                        f"{corpus_dir} nor in the job: make them first (`make distill`)")
    parity = [tok.encode_chat([{"role": "user", "content": row["prompt"]}])
              for row in first_turns(None, num_parity, spread=True)]
    job_dir.mkdir(parents=True, exist_ok=True)

    def flat(seqs: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        return (np.concatenate([np.zeros(0, np.int32)] + [np.asarray(x, np.int32) for x in seqs]),
                np.cumsum([0] + [len(x) for x in seqs]).astype(np.int64))

    t1_tok, t1_off = flat(t1_ids)
    fol_tok, fol_off = flat(src.follow_ids)
    par_tok, par_off = flat(parity)
    np.savez(job_dir / "job.npz", t1_job=np.asarray(t1_job, np.int64), t2_job=np.asarray(t2_job, np.int64),
             t1_row=np.asarray(t1_row, np.int64), t1_tok=t1_tok, t1_off=t1_off,
             t2_row=np.asarray(t2_row, np.int64), t2_follow=np.asarray(t2_follow, np.int64),
             t2_column=np.asarray(t2_column, np.int64), t2_parents=np.asarray(sorted(parents), np.int64),
             follow_tok=fol_tok, follow_off=fol_off, parity_tok=par_tok, parity_off=par_off)
    gguf = Path(target.path)
    data = gguf.read_bytes()
    if write_gguf:
        parts, _ = write_parts(data, job_dir / "gguf", preset=0)
        _bundle_gguf_reader(job_dir / "pylib")
    else:
        parts = len(list(job_dir.glob("gguf.xz.*")))
    import hashlib

    packs = {}
    # none yet, or the job's own corpus (its sequences are read once)
    selfs = [Path(d) for d in self_corpora if (Path(d) / "manifest.json").is_file()
             and Path(d).resolve() != Path(corpus_dir).resolve()]
    if pack_corpora:
        for key, folders in (("corpus", [corpus_dir]), ("text_corpus", [text_corpus] if text_corpus else []),
                             ("self_corpus", selfs)):
            if folders:
                packs[f"{key}_pack"] = pack_corpus([Path(f) for f in folders], job_dir / key.replace("_", "-"))
    spec = {"gguf_name": gguf.name, "gguf_sha256": hashlib.sha256(data).hexdigest(), "eos_ids": tok.eos_ids,
            "max_new_tokens": s.max_new_tokens, "max_prompt_tokens": s.max_prompt_tokens,
            "corpus": str(corpus_dir), "jobs": [j.name for j in todo], "turn1_prompts": len(t1_row),
            "turn2_rows": len(t2_row), "parity_prompts": len(parity),
            "parity_max_new_tokens": 128, "drafter": "mlx_redrafter/drafters/smollm2-135m",
            "text_corpus": str(text_corpus) if text_corpus else None,
            "self_corpora": [str(d) for d in selfs], "gguf_parts": parts, **packs}
    (job_dir / "job.json").write_text(json.dumps(spec, indent=1) + "\n")
    sizes = "".join(f"; {k[:-5].replace('_', ' ')}: {v['shards']} shards (xz) in {v['parts']} part(s)"
                    for k, v in packs.items())
    print(f"{job_dir}: {len(todo)} shards to make: {len(t1_row)} turn-1 prompts, {len(t2_row)} turn-2 rows; GGUF "
          f"(xz) in {parts} parts{sizes}")


def write_parts(data: bytes, stem: Path, preset: int) -> tuple[int, int]:
    """`data` xz-compressed in parts `<stem>.xz.0`, `.1`, ... of at most `GGUF_PART_BYTES` (earlier parts of that
    stem removed); returns (parts, compressed bytes)."""
    import lzma

    for old in stem.parent.glob(f"{stem.name}.xz.*"):
        old.unlink()
    packed = lzma.compress(data, preset=preset)
    parts = -(-len(packed) // GGUF_PART_BYTES)
    stem.parent.mkdir(parents=True, exist_ok=True)
    for k in range(parts):
        Path(f"{stem}.xz.{k}").write_bytes(packed[k * GGUF_PART_BYTES:(k + 1) * GGUF_PART_BYTES])
    return parts, len(packed)


def read_parts(name: str, parts: int, dirs: list[Path | None], what: str) -> bytes:
    """What `write_parts` wrote under stem `name`, from the first of `dirs` holding its first part; a missing part
    is one `error:` line."""
    import lzma

    where = next((d for d in dirs if d is not None and (d / f"{name}.xz.0").is_file()), None)
    paths = [(where or next(d for d in dirs if d is not None)) / f"{name}.xz.{k}" for k in range(parts)]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing or not paths:
        _fail(f"{what} part(s) missing: {', '.join(missing) or name}: copy every {name}.xz.* of the job there")
    return lzma.decompress(b"".join(p.read_bytes() for p in paths))


CORPUS_ARRAYS = ("prompt_len", "prompt_index", "turn")  # per sequence, besides its tokens


def pack_corpus(corpus_dirs: list[Path], stem: Path) -> dict[str, Any]:
    """Every shard of the corpora (their manifests') as one xz stream in parts `<stem>.xz.0`, `.1`, ... of at most
    `GGUF_PART_BYTES`: the token ids and per-sequence arrays run raw, shard after shard, and xz's 64 MiB window
    finds what they repeat (a turn-2 sequence holds its turn-1 conversation, asked again with each follow-up): the
    corpus of 2026-11-28, 38 MB of shards in git, packs into ~8 MB. `run` rebuilds the shards there
    (`unpack_corpus`), so that a transport too small for the checkout's corpus carries this instead. Returns the
    pack's entry of the job spec (parts, shards, sequences, bytes); no parts for corpora without shards. One
    corpus' shards keep their names; several corpora's are named `<corpus folder>/<shard>`, each its own split."""
    import io

    for old in stem.parent.glob(f"{stem.name}.xz.*"):
        old.unlink()
    entries, paths = {}, {}
    for corpus_dir in corpus_dirs:
        manifest = corpus_dir / "manifest.json"
        for n, e in (json.loads(manifest.read_text())["shards"] if manifest.is_file() else {}).items():
            if (corpus_dir / n).is_file():
                key = n if len(corpus_dirs) == 1 else f"{corpus_dir.name}/{n}"
                entries[key], paths[key] = e, corpus_dir / n
    names = sorted(entries)
    if not names:
        return {"parts": 0, "shards": 0, "sequences": 0, "bytes": 0}
    splits, counts, tokens, lengths = [], [], [], []
    per_seq: dict[str, list[np.ndarray]] = {k: [] for k in CORPUS_ARRAYS}
    for name in names:
        with np.load(paths[name]) as z:
            off = z["offsets"]
            tokens.append(z["tokens"])
            lengths.append(np.diff(off).astype(np.int64))
            for k in CORPUS_ARRAYS:
                per_seq[k].append(z[k])
        splits.append(entries[name]["split"])
        counts.append(len(lengths[-1]))
    buf = io.BytesIO()
    np.savez(buf, names=np.array(names), splits=np.array(splits), counts=np.array(counts, np.int64),
             tokens=np.concatenate(tokens).astype(np.result_type(*tokens)), lengths=np.concatenate(lengths),
             **{k: np.concatenate(v) for k, v in per_seq.items()})
    parts, size = write_parts(buf.getvalue(), stem, preset=9)
    return {"parts": parts, "shards": len(names), "sequences": int(sum(counts)), "bytes": size, "stem": stem.name}


def unpack_corpus(pack: dict[str, Any], dirs: list[Path], dest: Path) -> Path:
    """The shards of a `pack_corpus` pack, whose parts are in one of `dirs`, rebuilt in `dest` (uncompressed, with
    a manifest giving each shard's split: what `corpus_sequences` and `turn1_sequences` read). Returns `dest`."""
    import io

    with np.load(io.BytesIO(read_parts(pack["stem"], pack["parts"], dirs, "corpus pack"))) as z:
        data = {k: z[k] for k in z.files}
    seq_at = np.concatenate([[0], np.cumsum(data["counts"])])  # each shard's first sequence
    tok_at = np.concatenate([[0], np.cumsum(data["lengths"])])  # each sequence's first token
    shards = {}
    for i, (name, split) in enumerate(zip(data["names"].tolist(), data["splits"].tolist())):
        s0, s1 = int(seq_at[i]), int(seq_at[i + 1])
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        np.savez(dest / name, tokens=data["tokens"][tok_at[s0]:tok_at[s1]], offsets=tok_at[s0:s1 + 1] - tok_at[s0],
                 split=np.array(split), **{k: data[k][s0:s1] for k in CORPUS_ARRAYS})
        shards[name] = {"split": split}
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "manifest.json").write_text(json.dumps({"shards": shards}) + "\n")
    return dest


def _bundle_gguf_reader(dest: Path) -> None:
    """Copy the `gguf` package (pure Python; transformers needs it to read a GGUF) and its metadata into `dest`,
    for a CUDA machine that has torch and transformers but not it (`load_model` falls back to it)."""
    import importlib.metadata
    import shutil

    import gguf

    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(Path(gguf.__file__).parent, dest / "gguf", ignore=shutil.ignore_patterns("__pycache__"))
    meta = Path(str(importlib.metadata.distribution("gguf").locate_file(""))) / \
        f"gguf-{importlib.metadata.version('gguf')}.dist-info"
    if meta.is_dir():
        shutil.copytree(meta, dest / meta.name)


def _fail(msg: str) -> None:
    """One `error:` line, exit 2."""
    import sys

    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(2)


# ---------------------------------------------------------------------------------------------------------- there
def _log(msg: str, t0: float) -> None:
    print(f"[{time.perf_counter() - t0:7.1f}s] {msg}", flush=True)


def load_model(job_dir: Path, spec: dict, device: str, gguf_dir: Path | None = None) -> Any:
    """The target (float32) from the GGUF parts (in `gguf_dir`, else beside the job), via transformers' GGUF
    loader."""
    import hashlib
    import importlib.util
    import sys
    import tempfile

    if importlib.util.find_spec("gguf") is None and (job_dir / "pylib" / "gguf").is_dir():
        sys.path.insert(0, str(job_dir / "pylib"))  # the copy `prepare` bundled
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    data = read_parts("gguf", spec.get("gguf_parts", 3), [gguf_dir or job_dir], "GGUF")
    if hashlib.sha256(data).hexdigest() != spec["gguf_sha256"]:
        _fail("the GGUF parts do not add up to the prepared file: run prepare again")
    folder = Path(tempfile.mkdtemp(prefix="cuda-job-"))
    (folder / spec["gguf_name"]).write_bytes(data)
    model = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=spec["gguf_name"], dtype=torch.float32)
    return model.to(device).eval()


def _select_cache(cache: Any, idx: Any) -> None:
    """Keep the batch rows `idx` of a transformers cache."""
    for layer in cache.layers:
        layer.keys = layer.keys[idx]
        layer.values = layer.values[idx]


def greedy(model: Any, prompts: list[list[int]], max_new: int, eos_ids: list[int], device: str,
           compact_below: float = 0.75, top5: bool = False) -> tuple[list[list[int]], list[np.ndarray]]:
    """Greedy responses to a batch of prompts (left-padded with eos, finished rows dropped), each ending with an eos
    id where the model stopped by itself; with `top5`, the top-5 logits (values, ids) at every decided token."""
    import torch
    from transformers import DynamicCache

    from bench.torch_ref.compat import cache_kwarg

    B = len(prompts)
    lens = torch.tensor([len(p) for p in prompts], device=device)
    n = int(lens.max())
    tok = torch.full((B, n), eos_ids[0], dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        tok[b, n - len(p):] = torch.tensor(p, device=device)
    pad = n - lens
    am = (torch.arange(n, device=device)[None, :] >= pad[:, None]).long()
    pos = (torch.arange(n, device=device)[None, :] - pad[:, None]).clamp(min=0)
    cache = DynamicCache(config=model.config)
    kw = cache_kwarg(model)
    eos = torch.tensor(eos_ids, device=device)
    out = torch.full((B, max_new), -1, dtype=torch.long, device=device)
    steps_top: list[tuple[Any, Any, Any]] = []
    rows = torch.arange(B, device=device)
    nxt_pos = lens.clone()
    with torch.no_grad():
        logits = model(input_ids=tok, attention_mask=am, position_ids=pos, use_cache=True, logits_to_keep=1,
                       **{kw: cache}).logits[:, -1]
        for step in range(max_new):
            nxt = logits.argmax(-1)
            if top5:
                v, i = logits.float().topk(5, dim=-1)
                steps_top.append((rows, v, i))
            out[rows, step] = nxt
            live = ~torch.isin(nxt, eos)
            n_live = int(live.sum())  # the step's one host sync
            if step + 1 == max_new or n_live == 0:
                break
            if n_live < compact_below * len(rows):
                keep = live.nonzero()[:, 0]
                _select_cache(cache, keep)
                rows, nxt, am, nxt_pos = rows[keep], nxt[keep], am[keep], nxt_pos[keep]
            am = torch.cat([am, torch.ones_like(am[:, :1])], dim=1)
            logits = model(input_ids=nxt[:, None], attention_mask=am, position_ids=nxt_pos[:, None], use_cache=True,
                           logits_to_keep=1, **{kw: cache}).logits[:, -1]
            nxt_pos = nxt_pos + 1
    res = []
    eos_set = set(eos_ids)
    for r in out.cpu().tolist():
        resp = []
        for t in r:
            if t < 0:
                break
            resp.append(t)
            if t in eos_set:
                break
        res.append(resp)
    tops: list[list[np.ndarray]] = [[] for _ in range(B)]
    for r, v, i in steps_top:
        both = torch.cat([v, i.float()], dim=-1).cpu().numpy()
        for k, row in enumerate(r.tolist()):
            tops[row].append(both[k])
    return res, [np.stack(t) if t else np.zeros((0, 10), np.float32) for t in tops]


def _batches(lengths: list[int], max_rows: int, max_tokens: int) -> list[list[int]]:
    """Indices grouped by similar length: at most max_rows rows and max_tokens padded tokens per batch."""
    order = np.argsort(lengths, kind="stable")
    out, cur, longest = [], [], 0
    for i in order.tolist():
        L = max(longest, lengths[i])
        if cur and (len(cur) + 1 > max_rows or (len(cur) + 1) * L > max_tokens):
            out.append(cur)
            cur, L = [], lengths[i]
        cur.append(i)
        longest = L
    if cur:
        out.append(cur)
    return out


def turn1_sequences(corpus_dir: Path, shards: list[int], eos_ids: list[int]) -> dict[int, list[int]]:
    """The turn-1 sequences (prompt + answer) of the given shards that ended with eos, by plan row (numpy only; what
    `GreedySource.turn2_parts` reads)."""
    eos, out = set(eos_ids), {}
    for k in shards:
        with np.load(corpus_dir / f"shard-{k:05d}.npz") as z:
            tok, off, pl, rows = z["tokens"].astype(np.int64), z["offsets"], z["prompt_len"], z["prompt_index"]
        for i, r in enumerate(rows.tolist()):
            seq = tok[off[i]:off[i + 1]]
            if len(seq) > pl[i] and int(seq[-1]) in eos:
                out[r] = seq.tolist()
    return out


def prompt_check(prompt: list[int]) -> int:
    """A checksum of a prompt's ids: `land` finds each answer by its job, the prompt's length and this."""
    return zlib.crc32(np.asarray(prompt, np.int64).tobytes())


def turn2_units(job: dict, spec: dict, first: dict[int, list[int]]) -> list[Any]:
    """The job's turn-2 prompts as `slots.Unit`s keyed (2, job, plan row), one unit per (column of sibling jobs, row):
    each is the row's turn-1 sequence (from `first`, this run's answers, else the corpus) + a follow-up, skipped
    where `GreedySource.make` skips it (a first answer cut at max_new_tokens, or too long a prompt)."""
    from bench.torch_ref.slots import Unit

    first = {**turn1_sequences(Path(spec["corpus"]), sorted(set(job["t2_parents"].tolist()) - set(
        job["t1_job"].tolist())), spec["eos_ids"]), **first}
    follow = [job["follow_tok"][a:b].tolist() for a, b in zip(job["follow_off"][:-1], job["follow_off"][1:])]
    units: dict[tuple[int, int], Any] = {}
    for j, r, k, c in zip(*(job[x].tolist() for x in ("t2_job", "t2_row", "t2_follow", "t2_column"))):
        prefix = first.get(r)
        if prefix is None or len(prefix) + len(follow[k]) > spec["max_prompt_tokens"]:
            continue
        u = units.setdefault((c, r), Unit(prefix, [], []))
        u.follows.append(follow[k])
        u.keys.append((2, j, r))
    return list(units.values())


def generate_all(model: Any, job: dict, spec: dict, device: str, deadline: float, t0: float, slots: int,
                 save: Any) -> tuple[dict[tuple[int, int, int], tuple[list[int], list[int]]], list[int]]:
    """Greedy answers, (prompt, answer) keyed by (turn, job, plan row), and the jobs all of
    whose prompts were answered: turn 1 first, then turn 2 (whose prompts need turn 1's sequences, from the corpus
    or this run), job by job in the job's order, on a continuous batch of `slots` sequences
    (`bench/torch_ref/slots.py`); the turn-2 passes over one sequence prefill it once."""
    from bench.torch_ref.slots import Unit, generate

    eos_ids, max_new, max_prompt = spec["eos_ids"], spec["max_new_tokens"], spec["max_prompt_tokens"]
    got: dict[tuple[int, int, int], tuple[list[int], list[int]]] = {}
    prompts: dict[tuple[int, int, int], list[int]] = {}
    left: dict[int, int] = {}  # prompts still unanswered, by job
    done: list[int] = []
    tokens, last_save, tg = 0, time.perf_counter(), time.perf_counter()

    def answered(key: tuple[int, int, int], resp: list[int]) -> None:
        nonlocal tokens, last_save
        got[key] = (prompts[key], resp)
        tokens += len(resp)
        left[key[1]] -= 1
        if not left[key[1]]:
            done.append(key[1])
            _log(f"{len(done)} shards done: {len(got)} answers, {tokens} tokens, "
                 f"{tokens / (time.perf_counter() - tg):.0f} tokens/s", t0)
        if time.perf_counter() - last_save > 60:
            save(got, done)
            last_save = time.perf_counter()

    def run(units: list[Any]) -> None:
        for u in units:
            for f, key in zip(u.follows, u.keys):
                prompts[key] = u.prefix + f
                left[key[1]] = left.get(key[1], 0) + 1
        if units:
            generate(model, units, max_new, eos_ids, device, slots=slots, max_len=max_prompt + max_new,
                     deadline=deadline, on_answer=answered)

    t1_job, t1_row = job["t1_job"].tolist(), job["t1_row"].tolist()
    t1 = [job["t1_tok"][a:b].tolist() for a, b in zip(job["t1_off"][:-1], job["t1_off"][1:])]
    run([Unit(p[:-1], [p[-1:]], [(1, j, r)]) for j, r, p in zip(t1_job, t1_row, t1)])
    first = {r: p + got[(1, j, r)][1] for j, r, p in zip(t1_job, t1_row, t1)
             if (1, j, r) in got and got[(1, j, r)][1][-1] in eos_ids}
    run(turn2_units(job, spec, first))
    for j in sorted(set(job["t2_job"].tolist()) | set(t1_job)):
        if left.get(j, 0) == 0 and j not in done:
            done.append(j)  # every prompt skipped: a shard with no sequences
    return got, done


SEQ_PART_TOKENS = 6_000_000  # answer tokens per returned sequences file (uint16: well under 16 MiB)


def _save_sequences(out: Path, got: dict[tuple[int, int, int], tuple[list[int], list[int]]], done: list[int]) -> None:
    """sequences-<k>.npz: the answers of finished jobs (turn, job, row; the prompt's length and checksum; the
    answer), in files of at most SEQ_PART_TOKENS answer tokens (a returned file may hold 16 MiB); none when there
    is nothing to return (a training run: the transport returns at most 8 files)."""
    finished = set(done)
    if not finished and not got:
        return
    parts: list[list[tuple[int, int, int]]] = [[]]
    n = 0
    for k in sorted(k for k in got if k[1] in finished):
        if parts[-1] and n + len(got[k][1]) > SEQ_PART_TOKENS:
            parts.append([])
            n = 0
        parts[-1].append(k)
        n += len(got[k][1])
    for i, part in enumerate(parts):
        resp = [got[k][1] for k in part]
        tmp = out / f".sequences-{i}.tmp.npz"
        np.savez_compressed(tmp, key=np.array(part, np.int64).reshape(-1, 3),
                            prompt_len=np.array([len(got[k][0]) for k in part], np.int64),
                            prompt_crc=np.array([prompt_check(got[k][0]) for k in part], np.int64),
                            resp_tok=np.array([t for r in resp for t in r], np.uint16),
                            resp_off=np.cumsum([0] + [len(r) for r in resp]).astype(np.int64),
                            done=np.array(sorted(finished), np.int64))
        tmp.replace(out / f"sequences-{i}.npz")


def load_sequences(result_dir: Path) -> tuple[dict[tuple[int, int, int], list[int]], set[int]]:
    """What `_save_sequences` wrote: answers by (job, prompt length, prompt checksum), and the finished jobs."""
    got: dict[tuple[int, int, int], list[int]] = {}
    done: set[int] = set()
    for path in sorted(result_dir.glob("sequences-*.npz")):
        with np.load(path) as z:
            rt, ro = z["resp_tok"].astype(np.int64), z["resp_off"]
            for i, (key, n, crc) in enumerate(zip(z["key"].tolist(), z["prompt_len"].tolist(),
                                                   z["prompt_crc"].tolist())):
                got[(key[1], n, crc)] = rt[ro[i]:ro[i + 1]].tolist()
            done |= set(z["done"].tolist())
    return got, done


def corpus_sequences(corpus_dir: Path, limit: int | None = None, turn: int | None = None,
                     splits: tuple[str, ...] = ("train", "heldout")) -> dict[str, list[tuple[np.ndarray, int]]]:
    """(tokens, prompt_len) of every sequence of the corpus' shards of `splits` (of that `turn` only, if given), by
    split (numpy only; shards of other splits are not read); `limit` (a dry run) takes that many sequences of that
    many shards of each split."""
    manifest = json.loads((corpus_dir / "manifest.json").read_text())
    out: dict[str, list[tuple[np.ndarray, int]]] = {"train": [], "heldout": []}
    for name, entry in sorted(manifest["shards"].items()):
        path = corpus_dir / name
        if entry["split"] not in splits or not path.exists() or (limit and len(out[entry["split"]]) >= limit * limit):
            continue
        with np.load(path) as z:
            tok, off, pl, turns = z["tokens"].astype(np.int64), z["offsets"], z["prompt_len"], z["turn"]
        seqs = [(tok[off[i]:off[i + 1]], int(pl[i])) for i in range(len(pl)) if turn is None or turns[i] == turn]
        out[entry["split"]] += seqs[:limit] if limit else seqs
    return out


class Features:
    """Context positions of a set of sequences: the target's top-8 at every position p (labels for the step that
    ends at p), x_p's index into `tokens` and one past the end of p's sequence; and the hidden states h_p (float16;
    with `taps`, those layers' too) of the positions a draft may start from: every `stride`-th of a sequence, so
    that a corpus too large for the GPU's memory keeps all its sequences (~4.6 KB a start with three taps, 64 bytes
    a position). All on the GPU; `len` and `batch` count starts. With a `deadline` (a `time.perf_counter` value),
    the sequences are computed in `chunks` runs of consecutive ones, and once a run ends past the deadline the
    features keep the sequences done (at least one run): put the sequences that matter most first, in random
    order."""

    def __init__(self, model: Any, seqs: list[tuple[np.ndarray, int]], device: str, max_tokens: int = 65536,
                 taps: tuple[int, ...] = (), stride: int = 1, deadline: float | None = None, chunks: int = 40):
        import torch

        from bench.torch_ref.target import layer_outputs, rms_normalized

        lens = [len(s) for s, _ in seqs]
        starts = np.cumsum([0] + lens)
        self.tokens = torch.tensor(np.concatenate([s for s, _ in seqs]), device=device)
        ctx_counts = [len(s) - P for s, P in seqs]  # p = P-1 .. n-2
        cstart = np.cumsum([0] + ctx_counts)
        C = int(cstart[-1])
        n_starts = [-(-c // stride) for c in ctx_counts]
        sstart = np.cumsum([0] + n_starts)
        self.start = torch.cat([torch.arange(int(cstart[i]), int(cstart[i + 1]), stride) for i in range(len(seqs))]
                               + [torch.zeros(0, dtype=torch.long)]).to(device)  # position of each start
        H = model.config.hidden_size
        S = int(sstart[-1])
        self.hidden = torch.empty((S, H), dtype=torch.float16, device=device)
        self.top_ids = torch.empty((C, TOP_K), dtype=torch.int32, device=device)
        self.top_logp = torch.empty((C, TOP_K), dtype=torch.float16, device=device)
        self.tok_index = torch.empty(C, dtype=torch.long, device=device)
        self.seq_end = torch.empty(C, dtype=torch.long, device=device)
        self.taps = taps
        self.tap_hidden = torch.empty((S, len(taps), H), dtype=torch.float16, device=device) if taps else None
        def compute(first: int, end: int) -> None:  # the features of sequences first..end-1
            def dev(pieces: list[np.ndarray]) -> Any:
                return torch.from_numpy(np.concatenate(pieces).astype(np.int64)).to(device)

            for part in _batches(lens[first:end], 512, max_tokens):
                part = [first + i for i in part]
                n = max(lens[i] for i in part)
                ids = np.zeros((len(part), n), np.int64)
                am = np.zeros((len(part), n), np.int64)
                ctx_b, ctx_p, ctx_dst, start_b, start_p, start_dst, tok, ends = [], [], [], [], [], [], [], []
                for b, i in enumerate(part):  # right padding: positions 0..n-1, causal attention never sees pads
                    ids[b, : lens[i]] = seqs[i][0]
                    am[b, : lens[i]] = 1
                    pos = np.arange(seqs[i][1] - 1, lens[i] - 1)  # its context positions
                    ctx_b.append(np.full(len(pos), b))
                    ctx_p.append(pos)
                    ctx_dst.append(np.arange(cstart[i], cstart[i + 1]))
                    start_b.append(np.full(len(pos[::stride]), b))
                    start_p.append(pos[::stride])
                    start_dst.append(np.arange(sstart[i], sstart[i + 1]))
                    tok.append(starts[i] + pos)
                    ends.append(np.full(len(pos), starts[i + 1]))
                # one gather and one scatter per batch for every sequence in it (small per-sequence copies and
                # products cost more in launches than in arithmetic on a GPU)
                h = model.model(input_ids=torch.from_numpy(ids).to(device),
                                attention_mask=torch.from_numpy(am).to(device)).last_hidden_state  # post-norm
                sb, sp, sd = dev(start_b), dev(start_p), dev(start_dst)
                self.hidden[sd] = h[sb, sp].half()
                for j, layer in enumerate(taps):
                    self.tap_hidden[sd, j] = rms_normalized(caught[layer][sb, sp]).half()
                cb, cp, cd = dev(ctx_b), dev(ctx_p), dev(ctx_dst)
                for r0 in range(0, len(cd), 8192):
                    logits = model.lm_head(h[cb[r0 : r0 + 8192], cp[r0 : r0 + 8192]]).float()
                    v, k = torch.log_softmax(logits, -1).topk(TOP_K, dim=-1)
                    self.top_ids[cd[r0 : r0 + 8192]] = k.int()
                    self.top_logp[cd[r0 : r0 + 8192]] = v.half()
                self.tok_index[cd] = dev(tok)
                self.seq_end[cd] = dev(ends)

        done = len(seqs)
        bounds = np.unique(np.linspace(0, done, chunks + 1).astype(int)) if deadline is not None else [0, done]
        with torch.no_grad(), layer_outputs(model, taps) as caught:
            for a, b in zip(bounds[:-1], bounds[1:]):
                if deadline is not None and a > 0 and time.perf_counter() > deadline:
                    done = int(a)
                    break
                compute(int(a), int(b))
        self.sequences = done
        self.seq_starts = sstart[: done + 1]
        self.stride = stride
        self.seq_len, self.prompt_len = np.array(lens[:done], np.int64), np.array([P for _, P in seqs[:done]], np.int64)
        self.response_tokens = int(sum(ctx_counts[:done]))
        if done < len(seqs):  # views of the prefix: the positions of the sequences done
            S_done, C_done = int(sstart[done]), int(cstart[done])
            self.start, self.hidden = self.start[:S_done], self.hidden[:S_done]
            self.tap_hidden = self.tap_hidden[:S_done] if taps else None
            self.top_ids, self.top_logp = self.top_ids[:C_done], self.top_logp[:C_done]
            self.tok_index, self.seq_end = self.tok_index[:C_done], self.seq_end[:C_done]

    def __len__(self) -> int:
        return int(self.start.shape[0])

    def starts_of(self, sequences: int) -> int:
        """Starts of the first `sequences` sequences (they come first in every index; at most those done)."""
        return int(self.seq_starts[min(sequences, self.sequences)])

    def batch(self, starts: Any, T: int, lut: Any) -> dict[str, Any]:
        """make_batch of train/data.py for the drafts that start at `starts` (indices of starts, on the GPU)."""
        import torch

        idx = self.start[starts]  # their context positions
        t0 = self.tok_index[idx]
        steps = torch.arange(1, T + 1, device=idx.device)[None, :]
        valid = t0[:, None] + steps < self.seq_end[idx][:, None] - 1
        x = self.tokens[torch.clamp(t0[:, None] + steps, max=len(self.tokens) - 1)]
        rows = torch.where(valid, idx[:, None] + steps, torch.zeros_like(steps))
        head = lut[self.top_ids[rows, 0].long()]
        w = valid & (head >= 0)
        k_head = lut[self.top_ids[rows].long()]
        p = torch.exp(self.top_logp[rows].float()) * (k_head >= 0) * valid[..., None]
        p = p / p.sum(-1, keepdim=True).clamp(min=1e-9)
        taps = self.tap_hidden[starts].float() if self.taps else None
        return {"h": self.hidden[starts].float(), "taps": taps, "x": x, "target": head.clamp(min=0),
                "weight": w.float(), "valid": valid.float(), "soft_index": k_head.clamp(min=0), "soft_prob": p}


FEATURE_RESERVE = 8 << 30  # GPU bytes kept free beside the features: the feature pass's batches, then training


def fitting_stride(contexts: int, taps: int, hidden: int, free_bytes: int, stride: int = 1) -> int:
    """The smallest position stride >= `stride` at which the features of `contexts` context positions fit in
    `free_bytes` beside FEATURE_RESERVE: every position's labels and indices (64 bytes), and the float16 states
    (the last and `taps` tapped layers') and index of every stride-th one."""
    room = free_bytes - FEATURE_RESERVE - 64 * contexts
    per_start = 2 * hidden * (1 + taps) + 8
    if room <= per_start:
        _fail(f"the features of {contexts:,} context positions do not fit the GPU's {free_bytes / 2**30:.0f} GiB "
              f"free: train on fewer (--max-positions)")
    return max(stride, -(-contexts * per_start // room))


def context_of(drafter: Any, b: dict[str, Any], taps: tuple[int, ...], noise: float = 0.0) -> Any:
    """The drafter's context vector for a batch: the last state, fused with the tapped layers the drafter reads
    (`taps`: the layers the features hold); `noise`: U(-noise, noise) added to those states first (training)."""
    import torch

    layers = drafter.cfg.get("feature_layers") or []
    cols = [taps.index(layer) for layer in layers]
    h = torch.cat([b["h"], b["taps"][:, cols].flatten(1)], dim=-1) if layers else b["h"]
    if noise:
        h = h + torch.empty_like(h).uniform_(-noise, noise)
    return drafter.context(h) if layers else h


def teacher_forced_logits(drafter: Any, h: Any, emb: Any) -> Any:
    """Head logits (B, T, K): the RNN unrolled from state 0 over the input embeddings, as beam search does."""
    import torch

    s = torch.zeros_like(h)
    states = []
    for j in range(emb.shape[1]):
        s = drafter.next_state(s, emb[:, j])
        states.append(s)
    S = torch.stack(states, dim=1)
    return drafter.logits(h[:, None, :].expand_as(S), S)


def loss_of(logits: Any, b: dict[str, Any], soft: bool) -> Any:
    """hard_loss / soft_loss of train/loss.py."""
    import torch

    logp = torch.log_softmax(logits, dim=-1)
    if soft:
        ce = -(b["soft_prob"] * logp.gather(-1, b["soft_index"])).sum(-1)
        has = (b["soft_prob"].sum(-1) > 0).float()
        return ce.sum() / has.sum().clamp(min=1.0)
    ce = -logp.gather(-1, b["target"][..., None])[..., 0]
    return (ce * b["weight"]).sum() / b["weight"].sum().clamp(min=1.0)


def evaluate(drafter: Any, embed: Any, feats: Features, lut: Any, T: int) -> dict[str, Any]:
    """Held-out loss and top-1 accuracy per draft step on EVAL_POSITIONS positions (tokens outside the head count
    wrong), as train/loop.py's evaluate."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(1)
    idx = torch.randperm(len(feats), generator=g)[:EVAL_POSITIONS].sort().values.to(feats.hidden.device)
    with torch.no_grad():
        b = feats.batch(idx, T, lut)
        logits = teacher_forced_logits(drafter, context_of(drafter, b, feats.taps), embed(b["x"]))
        hit = (logits.argmax(-1) == b["target"]).float() * b["weight"]
        loss = loss_of(logits, b, soft=False)
    acc = (hit.sum(0) / b["valid"].sum(0).clamp(min=1)).tolist()
    return {"val_loss": round(float(loss), 4), "acc": [round(a, 4) for a in acc]}


REPLAY_LENGTH, REPLAY_TOKENS = 4, 128  # the drafter-alone cell the project judges drafters by: W1 L4, 128 tokens
RUNTIME_HEAD_ROWS = 8192  # the head rows the runtime drafts from by default (mlx_redrafter.defaults; no MLX here)


def replay_rate(drafter: Any, embed: Any, feats: Features, length: int = REPLAY_LENGTH,
                max_tokens: int = REPLAY_TOKENS, head_rows: int | None = None) -> dict[str, Any]:
    """Tokens per target call of greedy decoding with the drafter alone (beam width 1, beam length `length`: the
    target's next token and `length` - 1 drafted ones, from the head's first `head_rows` rows; None: all),
    replayed over the first `max_tokens` answer tokens of the features' sequences as train/replay.py replays them:
    a greedy sequence accepts a chain exactly as far as the chain matches it. A chain that matches its first k
    tokens was fed those same tokens, so the teacher-forced argmax at every start gives each start's accepted run;
    the walk then visits the starts decoding would. Needs features of every position (stride 1)."""
    import torch

    if feats.stride != 1:
        raise ValueError("replay needs the features of every position (stride 1)")
    runs = np.zeros(len(feats), np.int64)
    steps = torch.arange(1, length, device=feats.hidden.device)[None, :]
    rows = slice(None) if head_rows is None else slice(0, head_rows)
    with torch.no_grad():
        for r0 in range(0, len(feats), 8192):
            idx = torch.arange(r0, min(r0 + 8192, len(feats)), device=feats.hidden.device)
            pos = feats.start[idx]
            t0 = feats.tok_index[pos]
            ahead = t0[:, None] + 1 + steps  # the tokens the chain's steps must match
            valid = ahead < feats.seq_end[pos][:, None]
            truth = feats.tokens[torch.clamp(ahead, max=len(feats.tokens) - 1)]
            x = feats.tokens[torch.clamp(ahead - 1, max=len(feats.tokens) - 1)]  # g0, then the chain's own tokens
            h = {"h": feats.hidden[idx].float(), "taps": feats.tap_hidden[idx].float() if feats.taps else None}
            logits = teacher_forced_logits(drafter, context_of(drafter, h, feats.taps), embed(x))[..., rows]
            hit = (drafter.token_ids(logits.argmax(-1)) == truth) & valid
            runs[r0 : r0 + len(idx)] = torch.cumprod(hit.long(), dim=1).sum(1).cpu().numpy()
    decided = calls = 0
    hist = np.zeros(length, np.int64)
    for i in range(feats.sequences):
        base, P = int(feats.seq_starts[i]), int(feats.prompt_len[i])
        end = min(int(feats.seq_len[i]), P + max_tokens)
        p = P - 1  # the last position in the cache; the token after it is decided (the prefill's)
        while p + 2 < end:
            best = min(int(runs[base + p - (P - 1)]), end - (p + 2))
            new = min(best + 1, end - (p + 2))  # the accepted drafts and the target's own next token
            hist[best] += 1
            calls, decided, p = calls + 1, decided + new, p + new
    return {"tokens_per_call": round(decided / max(calls, 1), 4), "calls": calls, "sequences": feats.sequences,
            "accepted_hist": hist.tolist()}


def replay_sequences(seqs: list[tuple[np.ndarray, int]],
                     max_tokens: int = REPLAY_TOKENS) -> list[tuple[np.ndarray, int]]:
    """The part of each sequence a replay reads: the prompt and the answer's first `max_tokens` tokens."""
    return [(s[: P + max_tokens], P) for s, P in seqs]


def replays(drafter: Any, embed: Any, sets: dict[str, Features]) -> dict[str, float]:
    """The drafter's replayed tokens per call (`replay_rate`) on each named set; a head wider than the runtime's
    default rows also from those rows alone (`<set>@<rows>`), as the runtime drafts unless told otherwise."""
    out = {}
    rows = drafter.cfg.get("draft_vocab_size") or 0
    for name, feats in sets.items():
        out[name] = replay_rate(drafter, embed, feats)["tokens_per_call"]
        if rows > RUNTIME_HEAD_ROWS:
            out[f"{name}@{RUNTIME_HEAD_ROWS}"] = replay_rate(drafter, embed, feats,
                                                             head_rows=RUNTIME_HEAD_ROWS)["tokens_per_call"]
    return out


SOUP_ALPHAS = (1.0, 0.7, 0.5)  # shares of the trained weights in the drafters `soup` measures (1.0: as trained)


def soup(model: Any, start: dict[str, Any], embed: Any, sets: dict[str, Features],
         alphas: tuple[float, ...] = SOUP_ALPHAS) -> dict[str, Any]:
    """Leave `model` as the best of `start` + alpha * (trained - start) for `alphas` by its replayed tokens per call
    summed over `sets` (held-out answers; ties and no sets: the first alpha), the way a fine-tuned model is averaged
    with the one it grew from (WiSE-FT, arXiv 2109.01903): here the shipped drafter and run 10's averaged did better
    on both held-out sets than either (`bench/results/cpu-avx512/drafter-soup-20261201`). Returns each alpha's
    replays and the alpha kept."""
    import torch

    trained = {k: t.detach().clone() for k, t in model.state_dict().items()}

    def mixed(a: float) -> dict[str, Any]:
        return {k: t if a == 1.0 or not t.is_floating_point() else start[k] + a * (t - start[k])
                for k, t in trained.items()}

    scores: dict[str, Any] = {}
    best = None
    with torch.no_grad():
        for a in alphas if sets else alphas[:1]:
            model.load_state_dict(mixed(a))
            scores[str(a)] = replays(model, embed, sets)
            total = sum(v for k, v in scores[str(a)].items() if "@" not in k)
            if best is None or total > best[0]:
                best = (total, a)
        model.load_state_dict(mixed(best[1]))
    return {"replay_by_alpha": scores, "alpha": best[1]}


def grown(weights: dict[str, Any], cfg: dict[str, Any], extra_layers: int = 0, taps: tuple[int, ...] = (),
          head_rows: int = 0, counts: np.ndarray | None = None,
          target_rows: np.ndarray | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Drafter weights and config with `extra_layers` ResBlocks appended before the head, each starting at zero
    (x + SiLU(0) = x), and with `taps`, a `fuse` projection of [last state, tapped states...] to the context that
    starts as [I, 0, ..., 0]: the grown drafter drafts exactly what the given one does until training moves them.
    With `head_rows`, the head grows to that many rows by the tokens of highest `counts` it lacks, each from the
    target's output row (`target_rows`, (V, H)) carried into the head's space (`draft.head_rows.grow_head`)."""
    import torch

    out, cfg = dict(weights), dict(cfg)
    n, E, H = cfg["num_draft_layers"], cfg["exit_dim"], cfg["hidden_size"]
    if extra_layers:
        del out[f"lm_head.{n}.weight"]
        out[f"lm_head.{n + extra_layers}.weight"] = weights[f"lm_head.{n}.weight"]
        for j in range(n, n + extra_layers):
            out[f"lm_head.{j}.linear.weight"] = torch.zeros((E, E))
            out[f"lm_head.{j}.linear.bias"] = torch.zeros(E)
        cfg["num_draft_layers"] = n + extra_layers
    if taps and cfg.get("feature_layers") not in (None, list(taps)):
        _fail(f"the variant reads target layers {list(taps)} but the starting drafter reads "
              f"{cfg['feature_layers']}: start from a drafter without them, or with the same")
    if taps and not cfg.get("feature_layers"):
        out["fuse.weight"] = torch.cat([torch.eye(H), torch.zeros((H, H * len(taps)))], dim=1)
        cfg["feature_layers"] = list(taps)
    if head_rows and head_rows != cfg.get("draft_vocab_size"):
        from mlx_redrafter.draft.head_rows import grow_head

        if not cfg.get("draft_vocab_size") or counts is None or target_rows is None:
            _fail("a head grows from a drafter with a draft vocabulary, given the decisions' counts and the "
                  "target's output rows")
        key = f"lm_head.{cfg['num_draft_layers']}.weight"
        w, vocab = grow_head(out[key].float().cpu().numpy(), out["draft_vocab"].cpu().numpy(), target_rows, counts,
                             head_rows)
        out[key], out["draft_vocab"] = torch.from_numpy(w), torch.from_numpy(vocab)
        cfg["draft_vocab_size"] = head_rows
    return out, cfg


def start_config(drafter_dir: Path, init: Path | None) -> dict[str, Any]:
    """The config of the drafter a run starts from: `init`'s (a returned drafter file carries it in its metadata; a
    drafter folder's weights have it beside them), else the drafter folder's."""
    if init is not None:
        from safetensors import safe_open

        with safe_open(str(init), "np") as st:
            meta = (st.metadata() or {}).get("config")
        if meta:
            return json.loads(meta)
        if (init.parent / "config.json").is_file():
            return json.loads((init.parent / "config.json").read_text())
    return json.loads((drafter_dir / "config.json").read_text())


def part_files(first: Path) -> list[Path]:
    """A weights file and the parts that continue it (`first.1`, `first.2`, ... as `weight_parts` splits them)."""
    rest = sorted((p for p in first.parent.glob(f"{first.name}.*") if p.suffix[1:].isdigit()),
                  key=lambda p: int(p.suffix[1:]))
    if [int(p.suffix[1:]) for p in rest] != list(range(1, len(rest) + 1)):
        _fail(f"parts of {first} missing: found {', '.join(p.name for p in rest)}; every part from "
              f"{first.name}.1 on must be there")
    return [first, *rest]


ROW_BLOCK = ":rows"  # a tensor larger than a part travels as row blocks `<name>:rows0`, `<name>:rows1`, ...


def weight_parts(sd: dict[str, Any], limit: int = PART_BYTES) -> list[dict[str, Any]]:
    """The tensors of a state dict in groups of at most `limit` bytes each (one group where they fit); a tensor
    larger than `limit` is cut into blocks of whole rows (`ROW_BLOCK`) that fit, which `joined` puts together."""
    pieces: list[tuple[str, Any]] = []
    for k, t in sd.items():
        n = t.numel() * t.element_size()
        if n <= limit or t.dim() == 0:
            pieces.append((k, t))
            continue
        rows = max(1, limit // (n // t.shape[0]))
        pieces += [(f"{k}{ROW_BLOCK}{i}", t[r:r + rows].contiguous())
                   for i, r in enumerate(range(0, t.shape[0], rows))]
    parts: list[dict[str, Any]] = [{}]
    size = 0
    for k, t in pieces:
        n = t.numel() * t.element_size()
        if parts[-1] and size + n > limit:
            parts.append({})
            size = 0
        parts[-1][k] = t
        size += n
    return parts


def joined(weights: dict[str, Any]) -> dict[str, Any]:
    """`weights` (torch tensors or numpy arrays) with the row blocks `weight_parts` cut put back together."""
    out = {k: t for k, t in weights.items() if ROW_BLOCK not in k}
    blocks: dict[str, dict[int, Any]] = {}
    for k, t in weights.items():
        if ROW_BLOCK in k:
            name, i = k.rsplit(ROW_BLOCK, 1)
            blocks.setdefault(name, {})[int(i)] = t
    for name, got in blocks.items():
        if sorted(got) != list(range(len(got))):
            _fail(f"row blocks of {name} missing: got {sorted(got)}; copy every part of the drafter file")
        seq = [got[i] for i in range(len(got))]
        if type(seq[0]).__module__.startswith("torch"):
            import torch

            out[name] = torch.cat(seq)
        else:
            out[name] = np.concatenate(seq)
    return out


# Steps each variant must get for a side-by-side A/B to be kept: run 8 (36,015 steps of 1,024 starts) ended above
# its starting drafter at every draft step, run 9 (9,875 steps) below it (bench/results/h200/cuda-job-20261130-run8/).
MIN_VARIANT_STEPS = 30_000
TIMED_STEPS = 200  # steps whose time sets the schedule's length (and which variants go on)


def variants_that_fit(variants: tuple[str, ...], step_s: float, left_s: float, min_steps: int) -> tuple[str, ...]:
    """The first variants that still each get `min_steps` steps in `left_s` seconds side by side, where a step of
    all of them takes `step_s` (each its share): all, fewer, or the first alone however few steps it gets."""
    per_variant = step_s / len(variants)
    for k in range(len(variants), 1, -1):
        if left_s / (per_variant * k) >= min_steps:
            return variants[:k]
    return variants[:1]


def train(model: Any, train_f: Features, held_f: Features, drafter_dir: Path, out: Path, deadline: float,
          t0: float, batch: int, lr: float, T: int = 5, variants: tuple[str, ...] = ("soft-fuse3",),
          init: Path | None = None, greedy_starts: int | None = None, min_steps: int = MIN_VARIANT_STEPS,
          replay_sets: dict[str, Features] | None = None, soups: bool = True) -> dict:
    """Train one warm-started drafter per variant (`VARIANTS`) until `deadline`, from `drafter_dir`'s weights or
    `init`'s; save each (fp16, its config in the file's metadata). Measured before, at every checkpoint and after:
    the teacher-forced top-1 per draft step on `held_f`, and the tokens per call decoding with the drafter alone
    would reach on each of `replay_sets` (held-out answers cut by `replay_sequences`; `replays`). Each drafter
    returned is, with `soups`, the best by those replays of the trained one and its averages with its start
    (`soup`; the report's "after" measures it, and says which). The variants
    without text draw their batches from the first `greedy_starts` starts of `train_f` (the greedy answers), those
    with text from all of them; variants that draw from the same starts see the same batches. Once the step time
    is measured, the later variants stop where they would leave each fewer than `min_steps` steps
    (`variants_that_fit`): the first then trains alone with all the time left."""
    import torch
    from safetensors.torch import load_file, save_file

    from bench.torch_ref.drafter import TorchDrafter

    device = train_f.hidden.device
    base_cfg = start_config(drafter_dir, init)
    weights = joined({k: t for part in part_files(init or drafter_dir / "model.safetensors")
                      for k, t in load_file(str(part)).items()})
    n_greedy = len(train_f) if greedy_starts is None else greedy_starts
    embed_w = model.model.embed_tokens.weight.detach().float()

    def embed(x: Any) -> Any:
        return embed_w[x]

    counts = target_rows = None
    if any(VARIANTS[v].head_rows for v in variants):  # what a growing head adds: the decisions it lacks most
        counts = torch.bincount(train_f.top_ids[:n_greedy, 0].long(), minlength=base_cfg["vocab_size"]).cpu().numpy()
        target_rows = model.get_output_embeddings().weight.detach().float().cpu().numpy()
    models, opts, cfgs, luts, starts_w = {}, {}, {}, {}, {}
    for v in variants:
        w, cfgs[v] = grown(weights, base_cfg, VARIANTS[v].extra_layers, VARIANTS[v].taps, VARIANTS[v].head_rows,
                           counts, target_rows)
        d = TorchDrafter(cfgs[v])
        d.load_state_dict({k: (t.long() if k == "draft_vocab" else t.float()) for k, t in w.items()}, strict=True)
        models[v] = d.to(device).train()
        starts_w[v] = {k: t.detach().clone() for k, t in models[v].state_dict().items()}  # for `soup`
        opts[v] = torch.optim.AdamW([p for p in d.parameters()], lr=lr, betas=(0.9, 0.999), eps=1e-8,
                                    weight_decay=0.01)
        dv = models[v].draft_vocab  # label -> head row (-1: not in the head)
        luts[v] = torch.full((base_cfg["vocab_size"],), -1, dtype=torch.long, device=device)
        luts[v][dv] = torch.arange(len(dv), device=device)
    report: dict[str, Any] = {"batch": batch, "lr": lr, "T": T, "init": str(init or drafter_dir),
                              "train_starts": len(train_f), "greedy_starts": n_greedy,
                              "train_sequences": train_f.sequences, "heldout_contexts": len(held_f),
                              "head_coverage": {v: float((luts[v][train_f.top_ids[:, 0].long()] >= 0).float()
                                                         .mean()) for v in variants},
                              "variants": {v: {**vars(VARIANTS[v]), "config": cfgs[v]} for v in variants},
                              "before": evaluate(models[variants[0]], embed, held_f, luts[variants[0]], T),
                              "history": []}
    replay_sets = replay_sets or {}
    with torch.no_grad():
        report["before"]["replay"] = replays(models[variants[0]].eval(), embed, replay_sets)
    models[variants[0]].train()
    _log(f"train: {len(train_f)} starts ({n_greedy} greedy, {train_f.sequences} sequences); "
         f"before: {report['before']}", t0)

    def save(v: str) -> None:
        sd = {k: (t.int() if k == "draft_vocab" else t.half()).contiguous().cpu()
              for k, t in models[v].state_dict().items()}
        for k, part in enumerate(weight_parts(sd)):
            name = f"drafter_{v}.safetensors" + (f".{k}" if k else "")
            save_file(part, str(out / f".{name}"), metadata={"config": json.dumps(cfgs[v])})
            (out / f".{name}").replace(out / name)

    warmup, total, step, losses = 100, None, 0, {v: [] for v in variants}
    ts = time.perf_counter()
    gen = torch.Generator(device=device).manual_seed(0)
    while True:
        now = time.perf_counter()
        if total is None and step == TIMED_STEPS:  # the schedule's length from the measured step time
            per = (now - ts) / step
            keep = variants_that_fit(variants, per, deadline - now, min_steps)
            if keep != variants:
                report["dropped_variants"] = list(variants[len(keep):])
                _log(f"train: {per * 1000:.1f} ms/step for {len(variants)} variants leaves each fewer than "
                     f"{min_steps} steps: {', '.join(keep)} {'goes' if len(keep) == 1 else 'go'} on", t0)
                per *= len(keep) / len(variants)
                for v in variants[len(keep):]:  # their memory goes back to the ones that go on
                    del models[v], opts[v]
                variants = keep
            total = step + max(int((deadline - now) / per), 1)
            _log(f"train: {per * 1000:.1f} ms/step -> {total} steps", t0)
        if (total is not None and step >= total) or now > deadline:
            break
        if step < warmup:
            f = 0.01 + 0.99 * step / warmup
        elif total is None:
            f = 1.0
        else:
            c = min((step - warmup) / max(total - warmup, 1), 1.0)
            f = 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * c))
        starts, batches = {}, {}
        for text in sorted({VARIANTS[v].text for v in variants}):
            starts[text] = torch.randint(0, len(train_f) if text else n_greedy, (batch,), device=device,
                                         generator=gen).sort().values
        for v in variants:  # variants with the same data and head read the same batch
            key = (VARIANTS[v].text, cfgs[v].get("draft_vocab_size"))
            if key not in batches:
                b = train_f.batch(starts[key[0]], T, luts[v])
                batches[key] = (b, embed(b["x"]))
        for v in variants:
            b, emb = batches[(VARIANTS[v].text, cfgs[v].get("draft_vocab_size"))]
            for group in opts[v].param_groups:
                group["lr"] = lr * f
            logits = teacher_forced_logits(models[v], context_of(models[v], b, train_f.taps, VARIANTS[v].noise), emb)
            loss = loss_of(logits, b, soft=(VARIANTS[v].labels == "soft"))
            opts[v].zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(models[v].parameters(), 1.0)
            opts[v].step()
            losses[v].append(loss.detach())
        step += 1
        if step % 2000 == 0:
            rec = {"step": step, "positions_seen": step * batch, "elapsed_s": round(time.perf_counter() - ts, 1)}
            for v in variants:
                models[v].eval()
                rec[v] = {"train_loss": round(float(torch.stack(losses[v][-2000:]).mean()), 4),
                          **evaluate(models[v], embed, held_f, luts[v], T),
                          "replay": replays(models[v], embed, replay_sets)}
                models[v].train()
            report["history"].append(rec)
            _log(f"train: {json.dumps(rec)}", t0)
            for v in variants:  # kept as they go: a run cut short still returns its drafters
                save(v)
    report["steps"] = step
    report["positions_seen"] = step * batch
    report["epochs"] = round(step * batch / max(n_greedy, 1), 3)
    report["train_s"] = round(time.perf_counter() - ts, 1)
    for v in variants:  # returned: the trained drafter, or its average with where it started where that replays better
        models[v].eval()
        mix = soup(models[v], starts_w[v], embed, replay_sets) if soups else {"alpha": 1.0}
        report[v] = {**evaluate(models[v], embed, held_f, luts[v], T), "replay": replays(models[v], embed, replay_sets),
                     "soup": mix}
        save(v)
    _log(f"train: {step} steps; after: " + json.dumps({v: report[v] for v in variants}), t0)
    return report


def run(job_dir: Path, out: Path, budget_s: float, device: str = "cuda", limit: int | None = None,
        slots: int = 512, batch: int = 1024, lr: float = 5e-4, gen_share: float = 0.5,
        variants: tuple[str, ...] = ("soft-fuse3",), init: Path | None = None, parity: bool = True,
        gguf_dir: Path | None = None, train_too: bool = True, max_positions: int | None = None,
        feature_tf32: bool = False, position_stride: int = 1, feature_share: float = 0.5,
        min_variant_steps: int = MIN_VARIANT_STEPS, soups: bool = True) -> None:
    """Parity, generation, features and training (unless not `train_too`) within `budget_s` seconds; results in
    `out`. `max_positions`: train on a random subset of the corpus' sequences with at most that many context
    positions (each takes ~4.7 KB of GPU memory with three tapped layers: ~15M fit an 80 GB GPU); `feature_tf32`:
    the feature pass multiplies in TF32 (faster; states and labels then differ from float32 ones by ~1e-3);
    `position_stride`: drafts start from every that-many-th position of a sequence only (`Features`), raised where
    the features would not fit the GPU's memory (`fitting_stride`); the feature pass stops starting new sequences
    `feature_share` of the budget after the start (the greedy sequences go first, in random order, then the fixed
    text), so that training keeps the rest; `min_variant_steps` as `train`'s `min_steps`; `soups` as `train`'s."""
    import torch

    t0 = time.perf_counter()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    spec = json.loads((job_dir / "job.json").read_text())
    job = dict(np.load(job_dir / "job.npz"))
    out.mkdir(parents=True, exist_ok=True)
    # the packed corpora, where the job has them: the checkout's may be absent
    for key in ("corpus", "text_corpus", "self_corpora"):
        pack = spec.get(f"{key}_pack" if key != "self_corpora" else "self_corpus_pack")
        if spec.get(key) and pack and pack["parts"]:
            dest = str(unpack_corpus(pack, [gguf_dir, job_dir], job_dir / "unpacked" / key))
            spec[key] = [dest] if key == "self_corpora" else dest  # the self corpora: one pack, one folder
            _log(f"{key.replace('_', ' ')}: {pack['shards']} shards unpacked into {dest}", t0)
    report: dict[str, Any] = {"engine": ENGINE, "generation_engine": GEN_ENGINE, "torch": torch.__version__,
                              "device": device,
                              "device_name": torch.cuda.get_device_name(0) if device == "cuda" else "cpu"}
    import transformers

    report["transformers"] = transformers.__version__
    model = load_model(job_dir, spec, device, gguf_dir)
    _log(f"model loaded on {report['device_name']}", t0)

    # (1) parity: greedy ids and top-5 logits of the parity prompts
    if parity:
        par = [job["parity_tok"][a:b].tolist() for a, b in zip(job["parity_off"][:-1], job["parity_off"][1:])]
        tp = time.perf_counter()
        ids, tops = greedy(model, par, spec["parity_max_new_tokens"], spec["eos_ids"], device, top5=True)
        np.savez_compressed(out / "parity.npz", offsets=np.cumsum([0] + [len(x) for x in ids]),
                            ids=np.array([t for x in ids for t in x], np.int64), top5=np.concatenate(tops))
        _log(f"parity: {len(par)} prompts, {sum(map(len, ids))} tokens in {time.perf_counter() - tp:.1f} s", t0)
        from bench.torch_ref.slots import Unit, generate

        mine = generate(model, [Unit(p[:-1], [p[-1:]], [k]) for k, p in enumerate(par)],
                        spec["parity_max_new_tokens"], spec["eos_ids"], device, slots=8,
                        max_len=max(map(len, par)) + spec["parity_max_new_tokens"])
        same = sum(a == b for k, x in enumerate(ids) for a, b in zip(x, mine[k]))
        report["slot_parity"] = {"tokens": sum(map(len, ids)), "equal_to_transformers": same,
                                 "prompts_equal": sum(mine[k] == x for k, x in enumerate(ids))}
        _log(f"slot engine vs transformers: {report['slot_parity']}", t0)

    # (2) greedy answers
    gen_deadline = t0 + budget_s * gen_share
    if limit:  # a dry run: `limit` prompts of each turn, short answers
        job["t1_row"], job["t1_job"] = job["t1_row"][:limit], job["t1_job"][:limit]
        job["t1_off"] = job["t1_off"][: limit + 1]
        for key in ("t2_job", "t2_row", "t2_follow", "t2_column"):
            job[key] = job[key][:limit]
        spec["max_new_tokens"] = min(spec["max_new_tokens"], 16)
    tg = time.perf_counter()
    got, done = {}, []
    if gen_share > 0:
        got, done = generate_all(model, job, spec, device, gen_deadline, t0, slots,
                                 lambda g, d: _save_sequences(out, g, d))
    _save_sequences(out, got, done)
    if device == "cuda":
        torch.cuda.empty_cache()  # the generation's KV caches
    gen_tokens = sum(len(r) for _, r in got.values())
    report["generation"] = {"responses": len(got), "shards_done": len(done), "tokens": gen_tokens,
                            "seconds": round(time.perf_counter() - tg, 1),
                            "tokens_per_s": round(gen_tokens / max(time.perf_counter() - tg, 1e-9), 1)}
    _log(f"generation: {report['generation']}", t0)
    if not train_too:
        report["total_s"] = round(time.perf_counter() - t0, 1)
        (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
        _log("done", t0)
        return

    # (3) features of the committed corpus and the new sequences
    tf = time.perf_counter()
    seqs = corpus_sequences(Path(spec["corpus"]), limit)
    if max_positions:
        order = np.random.default_rng(0).permutation(len(seqs["train"]))
        kept, total = [], 0
        for i in order.tolist():
            n = len(seqs["train"][i][0]) - seqs["train"][i][1]
            if total + n > max_positions:
                break
            kept.append(seqs["train"][i])
            total += n
        _log(f"training on {len(kept)} of {len(seqs['train'])} corpus sequences ({total} context positions)", t0)
        seqs["train"] = kept
    torch.backends.cuda.matmul.allow_tf32 = feature_tf32
    new = [(np.asarray(p + r, np.int64), len(p)) for p, r in got.values() if r]  # noqa: RUF005
    text: list[tuple[np.ndarray, int]] = []
    if any(VARIANTS[v].text for v in variants):  # the fixed text's train shards; its held-out shard stays out
        if not spec.get("text_corpus"):
            _fail("a variant trains on fixed text but the job names no text corpus: run prepare again")
        text = corpus_sequences(Path(spec["text_corpus"]), limit)["train"]
    answers = seqs["train"] + new
    rng = np.random.default_rng(0)
    answers, text = [answers[i] for i in rng.permutation(len(answers))], [text[i] for i in rng.permutation(len(text))]
    # the answers to the target's own prompts first: their first turns are the most varied, and a feature pass
    # past its deadline keeps the sequences it reached
    own_dirs = [Path(d) for d in spec.get("self_corpora", []) if (Path(d) / "manifest.json").is_file()]
    own = [x for d in own_dirs for x in corpus_sequences(d, limit)["train"]]
    answers = [own[i] for i in rng.permutation(len(own))] + answers
    start = start_config(Path(spec["drafter"]), init).get("feature_layers") or []
    taps = tuple(sorted({layer for v in variants for layer in VARIANTS[v].taps} | set(start)))
    contexts = sum(len(s) - P for s, P in answers + text)
    if device == "cuda":
        stride = fitting_stride(contexts, len(taps), model.config.hidden_size, torch.cuda.mem_get_info()[0],
                                position_stride)
        if stride != position_stride:
            _log(f"position stride {stride} (not {position_stride}): the features of {contexts:,} positions then fit "
                 f"the GPU's free memory", t0)
        position_stride = stride
    held_f = Features(model, seqs["heldout"], device, taps=taps)
    # decoding's measure of the drafters: replayed tokens per call on the held-out first turns of each corpus
    held = ("heldout",)  # the held-out shards alone: the train shards were read above
    firsts = {"heldout": corpus_sequences(Path(spec["corpus"]), limit, turn=1, splits=held)["heldout"],
              "self_heldout": [x for d in own_dirs for x in corpus_sequences(d, limit, turn=1, splits=held)["heldout"]]}
    replay_sets = {k: Features(model, replay_sequences(v), device, taps=taps) for k, v in firsts.items() if v}
    train_f = Features(model, answers + text, device, taps=taps, stride=position_stride,
                       deadline=t0 + budget_s * feature_share)
    greedy_starts = train_f.starts_of(len(answers))
    greedy_contexts = sum(len(s) - P for s, P in answers[: train_f.sequences])
    report["features"] = {"train_sequences": train_f.sequences, "sequences_offered": len(answers) + len(text),
                          "train_starts": len(train_f),
                          "position_stride": position_stride, "greedy_starts": greedy_starts,
                          "greedy_contexts": greedy_contexts, "new_sequences": len(new),
                          "self_prompted_sequences": len(own),
                          "text_sequences": len(text), "heldout_contexts": len(held_f), "tf32": feature_tf32,
                          "replay_sequences": {k: f.sequences for k, f in replay_sets.items()},
                          "seconds": round(time.perf_counter() - tf, 1)}
    _log(f"features: {report['features']}", t0)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")

    # (4) training until the budget's end (a margin for evaluation and saving)
    torch.backends.cuda.matmul.allow_tf32 = True
    report["train"] = train(model, train_f, held_f, Path(spec["drafter"]), out, t0 + budget_s - 20, t0, batch, lr,
                            variants=variants, init=init, greedy_starts=greedy_starts, min_steps=min_variant_steps,
                            replay_sets=replay_sets, soups=soups)
    report["total_s"] = round(time.perf_counter() - t0, 1)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    _log("done", t0)


# ----------------------------------------------------------------------------------------------------------- here
def land(result_dir: Path, prompts_file: Path, corpus_dir: Path) -> None:
    """Shards of the plan from the run's answers, through the corpus' own code (`distill.grow`): the shards the run
    finished, each entry naming the engine and device and carrying the run's generation rate."""
    from mlx_redrafter.errors import UserError
    from mlx_redrafter.models.loader import load_target
    from mlx_redrafter.train.distill import grow
    from mlx_redrafter.train.greedy import GreedySource

    target = load_target(None)
    got, done = load_sequences(result_dir)
    report = json.loads((result_dir / "report.json").read_text())
    rate = report["generation"]["tokens"] / max(report["generation"]["seconds"], 1e-9)  # the run's, shared out

    class CudaAnswers(GreedySource):
        """Greedy shards whose answers were made on the CUDA machine (`ENGINE` in each manifest entry)."""

        def jobs(self):
            return [j for j in super().jobs() if j.index in done]

        def companions(self, job, todo):
            return []  # answers are looked up one shard at a time (`answer`), never generated here

        def answer(self, prompts):
            keys = [(self.job.index, len(p), prompt_check(p)) for p in prompts]
            missing = sum(k not in got for k in keys)
            if missing:
                raise UserError(f"{result_dir}: {missing} prompts of a finished shard have no answer: the run and "
                                f"this plan differ (run prepare again before the next run)")
            return [got[k] for k in keys], None

        def make(self, job, corpus, progress):
            self.job = job
            made = super().make(job, corpus, progress)
            resp = made.response_tokens
            made.info.update(engine=report.get("generation_engine", ENGINE), device=report.get("device_name", "?"),
                             seconds=round(resp / rate, 1), new_tokens_per_s=round(rate, 1))
            return made

    grow(CudaAnswers(target, prompts_file), target, corpus_dir, progress=False)
    drafter_folders(result_dir, Path("runs/cuda") / result_dir.name)


def drafter_folders(result_dir: Path, dest: Path) -> list[Path]:
    """Each `drafter_<variant>.safetensors` of a run as an MLX drafter folder `dest/<variant>/` (config.json from
    the file's metadata; a file without one, from an earlier run, gets the shipped drafter's config with the
    ResBlock count its weights have; model.safetensors as returned)."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    from mlx_redrafter.shipped import shipped_folder

    shipped = json.loads((shipped_folder("smollm2-135m") / "config.json").read_text())
    made = []
    for f in sorted(result_dir.glob("drafter_*.safetensors")):
        weights: dict[str, np.ndarray] = {}
        for part in part_files(f):
            with safe_open(str(part), "np") as st:
                weights.update({k: st.get_tensor(k) for k in st.keys()})
                if part == f:
                    meta = (st.metadata() or {}).get("config")
        weights = joined(weights)
        cfg = json.loads(meta) if meta else {**shipped, "num_draft_layers": sum(
            k.startswith("lm_head.") and k.endswith(".linear.weight") for k in weights)}
        folder = dest / f.stem.removeprefix("drafter_")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        save_file(weights, str(folder / "model.safetensors"))
        made.append(folder)
        print(f"{folder}: drafter ({f.name})")
    return made


def parity(result_dir: Path, job_dir: Path) -> dict[str, Any]:
    """The CUDA run's greedy answers to the parity prompts against the runtime's own model here: at every position
    the CUDA run decided, the MLX argmax over the same context and the largest difference of the top-5 logits."""
    import mlx.core as mx

    from mlx_redrafter.models.loader import load_target

    target = load_target(None)
    spec = json.loads((job_dir / "job.json").read_text())
    with np.load(job_dir / "job.npz") as z:
        prompts = [z["parity_tok"][a:b].tolist() for a, b in zip(z["parity_off"][:-1], z["parity_off"][1:])]
    with np.load(result_dir / "parity.npz") as z:
        off, ids, top5 = z["offsets"], z["ids"], z["top5"]
    same = total = equal_prompts = 0
    worst = 0.0
    first_diff = []
    for k, p in enumerate(prompts):
        got = ids[off[k]:off[k + 1]].tolist()
        cache = target.model.make_cache(len(p) + len(got))
        logits, _ = target.model(mx.array([p + got[:-1]]), cache)
        ours = np.array(logits[0, len(p) - 1:].astype(mx.float32))
        mine = ours.argmax(-1)
        agree = mine == np.array(got)
        same += int(agree.sum())
        total += len(got)
        equal_prompts += bool(agree.all())
        first_diff.append(int(np.argmin(agree)) if not agree.all() else None)
        t = top5[off[k]:off[k + 1]]
        vals, tids = t[:, :5], t[:, 5:].astype(np.int64)
        worst = max(worst, float(np.abs(np.take_along_axis(ours, tids, -1) - vals).max()))
    out = {"prompts": len(prompts), "max_new_tokens": spec["parity_max_new_tokens"], "tokens": total,
           "argmax_equal": same, "prompts_all_equal": equal_prompts, "first_difference": first_diff,
           "max_abs_top5_logit_diff": round(worst, 6)}
    print(json.dumps(out))
    return out


def main() -> None:
    """The command line; bad input is one `error:` line and exit 2."""
    import sys

    try:
        _main()
    except (OSError, KeyError, ValueError) as e:  # a missing or foreign job / result folder
        print(f"error: {type(e).__name__}: {e}: give the folder `prepare` wrote (--job) or `run` filled (--out)",
              file=sys.stderr)
        sys.exit(2)
    except Exception as e:  # mlx_redrafter's UserError (here); not imported there, where MLX is absent
        if type(e).__name__ != "UserError":
            raise
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def _main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--job", type=Path, default=Path(".gpu"))
    p.add_argument("--prompts", type=Path, default=Path("../shared/data/train_prompts.jsonl"))
    p.add_argument("--corpus", type=Path, default=Path("data/corpus/smollm2-135m"))
    p.add_argument("--text-corpus", type=Path, default=Path("data/corpus/smollm2-135m-text"),
                   help="the fixed-text corpus the variants with text train on")
    p.add_argument("--self-corpus", type=Path, action="append", default=None,
                   help="answers to the target's own prompts (`distill --source self`), trained on first; repeat "
                        "for several (default: every data/corpus/smollm2-135m-self* with shards)")
    p.add_argument("--from-end", action="store_true", help="the plan's last shards first (a CPU data job beside)")
    p.add_argument("--max-shards", type=int, default=None, help="at most this many shards in the job")
    r = sub.add_parser("run")
    r.add_argument("--job", type=Path, default=Path(".gpu"))
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--budget-s", type=float, default=450)
    r.add_argument("--device", default="cuda")
    r.add_argument("--limit", type=int, default=None, help="a dry run: this many prompts and sequences per shard")
    r.add_argument("--slots", type=int, default=512, help="sequences generated at once")
    r.add_argument("--batch", type=int, default=1024)
    r.add_argument("--lr", type=float, default=5e-4)
    r.add_argument("--gen-share", type=float, default=0.5)
    r.add_argument("--variants", default="soft-fuse3",
                   help="drafters trained side by side, comma-separated: " + ", ".join(VARIANTS))
    r.add_argument("--init", type=Path, default=None, help="start from these drafter weights (same shape)")
    r.add_argument("--no-parity", action="store_true")
    r.add_argument("--gguf-dir", type=Path, default=None,
                   help="where the GGUF and corpus parts are (default: the job folder)")
    r.add_argument("--generate-only", action="store_true", help="no features and no training after generation")
    r.add_argument("--max-positions", type=int, default=None,
                   help="train on a random subset of the corpus with at most this many context positions")
    r.add_argument("--feature-tf32", action="store_true", help="the feature pass in TF32 (faster, ~1e-3 off)")
    r.add_argument("--position-stride", type=int, default=1,
                   help="drafts start from every N-th position only (states of 1/N of the positions in memory; "
                        "raised where they would not fit)")
    r.add_argument("--feature-share", type=float, default=0.5,
                   help="the feature pass starts no new sequences past this share of the budget")
    r.add_argument("--no-soup", action="store_true",
                   help="return each drafter as trained, not its best average with its start (`soup`)")
    r.add_argument("--min-variant-steps", type=int, default=MIN_VARIANT_STEPS,
                   help="the later variants stop where side by side they would each get fewer steps than this; "
                        "the first then trains alone (0: never)")
    m = sub.add_parser("land")
    m.add_argument("result", type=Path)
    m.add_argument("--prompts", type=Path, default=Path("../shared/data/train_prompts.jsonl"))
    m.add_argument("--corpus", type=Path, default=Path("data/corpus/smollm2-135m"))
    q = sub.add_parser("parity")
    q.add_argument("result", type=Path)
    q.add_argument("--job", type=Path, default=Path(".gpu"))
    a = ap.parse_args()
    if a.cmd == "run":
        if a.position_stride < 1 or (a.max_positions is not None and a.max_positions < 1):
            _fail("--position-stride and --max-positions take a number >= 1")
        if not 0 < a.feature_share <= 1:
            _fail("--feature-share takes a share of the budget, more than 0 and at most 1")
        if a.min_variant_steps < 0:
            _fail(f"--min-variant-steps {a.min_variant_steps}: give a number of steps, 0 or more")
        unknown = [v for v in a.variants.split(",") if v not in VARIANTS]
        if unknown:
            _fail(f"unknown variant(s) {', '.join(unknown)}: choose from {', '.join(VARIANTS)}")
    if a.cmd == "prepare":
        bare = [str(d) for d in a.self_corpus or [] if not (d / "manifest.json").is_file()]
        if bare:
            _fail(f"--self-corpus {', '.join(bare)}: no corpus there (no manifest.json): answer its prompts first "
                  "(`make distill DISTILL_ARGS=\"--corpus-name NAME\"`) or leave it out")
    if a.cmd == "prepare" and a.max_shards is not None and a.max_shards < 0:
        _fail(f"--max-shards {a.max_shards}: give a count of shards, 0 or more (0: a job for training only)")
    if a.cmd == "prepare":
        prepare(a.job, a.prompts, a.corpus, from_end=a.from_end, max_shards=a.max_shards,
                text_corpus=a.text_corpus,
                self_corpora=a.self_corpus or sorted(Path("data/corpus").glob("smollm2-135m-self*")))
    elif a.cmd == "run":
        run(a.job, a.out, a.budget_s, a.device, a.limit, a.slots, a.batch, a.lr, a.gen_share,
            tuple(a.variants.split(",")), a.init, not a.no_parity, a.gguf_dir, not a.generate_only,
            a.max_positions, a.feature_tf32, a.position_stride, a.feature_share, a.min_variant_steps,
            not a.no_soup)
    elif a.cmd == "parity":
        parity(a.result, a.job)
    else:
        land(a.result, a.prompts, a.corpus)


if __name__ == "__main__":
    main()
