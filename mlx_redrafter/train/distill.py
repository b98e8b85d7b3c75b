"""Growing a corpus from a source of sequences: the job loop shared by every source.

Three sources produce sequences for the same corpus format (`corpus.py`):

    greedy.GreedySource      the target's own greedy answers to the plan's prompts (self-distillation)
    text.TextSource          fixed public instruction/response text (labels come from the target's teacher-forced
                             pass, never from the text)
    endpoint.EndpointSource  answers from any OpenAI-compatible completions endpoint (vLLM, llama.cpp, mlx-lm, ...)

A source splits its work into jobs (one shard each) and makes the sequences of a job; `grow` runs the missing
jobs of a corpus: resumable, a corrupt shard regenerated, N worker processes sharing one corpus (job index
modulo N), bounded by shards or hours, with progress and an ETA.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from mlx_redrafter.errors import UserError
from mlx_redrafter.models.loader import Target
from mlx_redrafter.train.corpus import FORMAT, Corpus, shard_bytes
from mlx_redrafter.train.plan import Job

# Free disk the data job leaves beside the states it keeps (SmolLM2-135M with three tapped layers: ~4.6 kB a
# response token, ~0.4 GB a shard): past it, a shard's states are dropped, rebuilt by the feature pass when needed.
KEEP_FREE_BYTES = 8 * 1024**3


def target_fingerprint(target: Target) -> str:
    """Short hash of the target's config and weights (labels and features are only valid for this target)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    h = hashlib.sha256(json.dumps(vars(target.model.args), sort_keys=True, default=str).encode())
    for k, v in sorted(tree_flatten(target.model.parameters()), key=lambda kv: kv[0]):
        h.update(k.encode())
        h.update(np.array(v.astype(mx.float32)[:2].reshape(-1)[:64]).tobytes())  # cheap: first rows of each
    return h.hexdigest()[:16]


@dataclass
class Made:
    """The sequences of one job, and what the manifest should say about them."""

    seqs: list[list[int]]  # prompt + response token ids
    prompt_lens: list[int]
    index: list[int]  # the source row of each sequence
    turns: list[int] | int = 1
    info: dict[str, Any] = field(default_factory=dict)  # extra manifest fields (sources, eos stops, ...)
    hidden: list[np.ndarray] | None = None  # per sequence: the target's states at its context positions, if kept
    layers: tuple[int, ...] = ()  # the target layers whose states follow the last one in `hidden`

    @property
    def response_tokens(self) -> int:
        return sum(len(s) - p for s, p in zip(self.seqs, self.prompt_lens))


class SequenceSource(Protocol):
    """Where a corpus' sequences come from (see the module docstring)."""

    kind: str  # "greedy" | "text" | "endpoint"

    def identity(self) -> dict[str, Any]:
        """What makes this corpus; checked against the manifest of an existing corpus (`checked_keys`)."""

    def checked_keys(self) -> tuple[str, ...]:
        """Identity keys that must match an existing corpus."""

    def jobs(self) -> list[Job]:
        """Every shard of the full corpus, in order."""

    def total(self, job: Job) -> int:
        """The units of work of a job for the progress bar (prompts)."""

    def ready(self, job: Job, corpus: Corpus) -> str | None:
        """None if the job can run now, else why not (e.g. a turn-2 job whose turn-1 shards are not made yet)."""

    def make(self, job: Job, corpus: Corpus, progress: Callable[[int, int], None]) -> Made:
        """The sequences of `job`; calls progress(units done, new tokens) as it goes."""

    # Optional: `companions(job, todo) -> list[Job]` (jobs of `todo` that share work with `job`) and
    # `make_group(jobs, corpus, progress) -> list[Made]` (them made together), used by `grow` where present.


PARTIAL_DIR = "partial"  # a corpus' shards being made: committed beside it, removed once each shard is written


def partial_path(corpus: Corpus, name: str) -> Path:
    """Where a source may keep the finished part of shard `name` while making it (token ids and what they cost),
    so that an interrupted run resumes inside the shard: `partial/<name>` in the corpus, committed with it, so that
    a shard that takes longer than a machine keeps its files resumes on the next one; removed once the shard is
    written."""
    return corpus.root / PARTIAL_DIR / name


def partial_states_path(corpus: Corpus, name: str) -> Path:
    """Where a source keeps the hidden states it captured with the finished part of shard `name`: a dot file beside
    the corpus, ignored by git (states are local, derived data; where they are missing the features are rebuilt)."""
    return corpus.root / f".{name}.states.partial.npz"


def grow(source: SequenceSource, target: Target, root: str | Path, *, worker: tuple[int, int] = (0, 1),
         max_shards: int | None = None, hours: float | None = None, features_dir: str | Path | None = None,
         progress: bool = True, log: Callable[[str], None] = print) -> Corpus:
    """Extend the corpus at `root` with the next missing shards of `source`; returns the corpus.

    `worker=(i, n)`: make only the shards whose index is i modulo n (n processes, one per core, one BLAS thread
    each). `max_shards` / `hours` bound this run (a shard is never cut in the middle). With `features_dir`, the
    hidden states a source computed anyway are kept there (`features.py`).
    """
    corpus = Corpus(root, target.model.args.vocab_size)
    ident = {"format": FORMAT, "source": source.kind, "model": target.name, "target_fingerprint":
             target_fingerprint(target), "dtype": target.dtype, **source.identity()}
    corpus.claim(ident, ("source", "model", "target_fingerprint", "dtype", *source.checked_keys()))
    jobs = [j for j in source.jobs() if j.index % worker[1] == worker[0]]
    todo = []
    for job in jobs:
        problem = corpus.check(job.name)
        if problem is None:
            continue
        if problem != "missing":
            log(f"{corpus.root / job.name} is {problem}: regenerating it")
        todo.append(job)
    if max_shards is not None:
        todo = todo[:max_shards]
    # one bar per shard (or group of shards made together): its ETA is that of the work in hand, not of the whole
    # plan (months of one CPU); the total left is logged once
    bar = None
    if progress and todo:
        log(f"distill {corpus.name} ({source.kind}): shards to make: {len(todo)} (worker {worker[0]}/{worker[1]}), "
            f"{sum(source.total(j) for j in todo)} answers")
    t_run = t_bar = time.perf_counter()
    made_tokens = 0

    def start_bar(group: list[Job]) -> None:
        nonlocal bar, t_bar, made_tokens
        if not progress:
            return
        from tqdm import tqdm

        if bar is not None:
            bar.close()
        name = group[0].name + (f" +{len(group) - 1}" if len(group) > 1 else "")
        bar = tqdm(total=sum(source.total(j) for j in group), desc=f"distill {corpus.name} {name}", unit="answer",
                   dynamic_ncols=True, smoothing=0.05)
        t_bar, made_tokens = time.perf_counter(), 0

    def advance(units: int, tokens: int) -> None:
        nonlocal made_tokens
        made_tokens += tokens
        if bar is not None and not tokens:  # made before (a resumed shard) or skipped: not this run's pace
            bar.initial += units
            bar.n += units
            bar.last_print_n = bar.n
            bar.refresh()
        elif bar is not None:
            bar.update(units)
            bar.set_postfix_str(f"{made_tokens / max(time.perf_counter() - t_bar, 1e-9):.0f} tok/s, "
                                f"{made_tokens} new tokens")

    def write(job: Job, made: Made, seconds: float, cpu_seconds: float) -> None:
        info = dict(made.info)
        seconds += info.pop("resumed_seconds", 0.0)  # an interrupted shard's earlier part
        cpu_seconds += info.pop("resumed_cpu_seconds", 0.0)
        data = shard_bytes(made.seqs, made.prompt_lens, made.index, made.turns, job.split,
                           target.model.args.vocab_size)
        if features_dir is not None and made.hidden is not None:  # derived data, local, never committed
            from mlx_redrafter.train.features import save_hidden

            size = sum(h.nbytes for h in made.hidden)
            Path(features_dir).mkdir(parents=True, exist_ok=True)  # as the first save would
            free = shutil.disk_usage(features_dir).free
            if free - size >= KEEP_FREE_BYTES:
                save_hidden(features_dir, job.name, hashlib.sha256(data).hexdigest(), made.hidden, made.layers)
            else:
                log(f"{job.name}: its states ({size / 1e9:.1f} GB) not kept, {free / 1e9:.1f} GB free in "
                    f"{features_dir}: the feature pass rebuilds them (free space there to keep them)")
        resp = made.response_tokens
        corpus.write_shard(job.name, data, {
            "turn": job.turn, "split": job.split, "sequences": len(made.seqs), "response_tokens": resp,
            "plan_rows": [job.rows[0], job.rows[-1]] if job.rows else [], "parents": job.parents,
            "seconds": round(seconds, 1), "new_tokens_per_s": round(resp / max(seconds, 1e-9), 1),
            # this process's CPU time: unlike wall time, not inflated by other work sharing the cores or by the
            # job being paused (SIGSTOP) for a benchmark; a source that made the sequences elsewhere (its info
            # has its own seconds) says what they cost there instead
            **({} if "seconds" in info else {"cpu_seconds": round(cpu_seconds, 1)}), **info,
        })
        for path in (partial_path(corpus, job.name), partial_states_path(corpus, job.name)):
            path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # the folder of shards being made, once none is left
            partial_path(corpus, job.name).parent.rmdir()
        log(f"{job.name}: {source.kind} turn {job.turn} {job.split}, {len(made.seqs)} sequences, {resp} response "
            f"tokens, {seconds:.0f} s ({resp / max(seconds, 1e-9):.0f} tok/s); corpus "
            f"{corpus.stats()['response_tokens']} response tokens")

    made_already: set[int] = set()
    try:
        for job in todo:
            if job.index in made_already:
                continue
            if hours is not None and time.perf_counter() - t_run > hours * 3600:
                log(f"time budget of {hours} h reached: stopping before {job.name}")
                break
            why = source.ready(job, corpus)
            if why is not None:
                log(f"{job.name}: {why}: skipped for now")
                continue
            # a source may make several jobs together that share work (GreedySource: one prefill for the turn-2
            # passes over the same sequences); their cost is split equally between their shards
            group = [job, *(source.companions(job, [j for j in todo if j.index not in made_already])
                            if hasattr(source, "companions") else [])]
            start_bar(group)
            t0, c0 = time.perf_counter(), time.process_time()
            mades = source.make_group(group, corpus, advance) if len(group) > 1 else [source.make(job, corpus, advance)]
            seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
            for j, made in zip(group, mades):
                write(j, made, seconds / len(group), cpu_seconds / len(group))
                made_already.add(j.index)
    finally:
        if bar is not None:
            bar.close()
    return corpus


def check_worker(spec: str) -> tuple[int, int]:
    """I/N from a --worker option (0 <= I < N); a one-line UserError otherwise."""
    try:
        i, n = (int(v) for v in spec.split("/"))
        if not 0 <= i < n:
            raise ValueError
    except ValueError:
        raise UserError(f"--worker takes I/N with 0 <= I < N, e.g. 0/2 (got {spec!r})") from None
    return i, n
