"""The scheduler: one thread owns the model and serves every active request, all of them in each target call.

Up to `max_active` requests run at once and `max_queued` more wait (one more is a 429). Running requests are the
rows of one `batch.loop.Batch`: every step is one target call for all of them (continuous batching), each row
with its own draft mode, sampling settings and candidate length, so a long answer never stalls a short one and a
new request joins between two steps without recomputing the others. A request whose client went away leaves at
the next step. Finished requests leave their KV cache in a small LRU keyed by the tokens it holds, and a request
that starts with the same tokens (the earlier turns of a conversation) continues from it: only the new tokens
are prefilled. Jobs admitted together with one prompt (a request's `n` choices) share one prefill.

The HTTP side never touches MLX: it hands a `Job` over and reads its events.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import mlx.core as mx

from mlx_redrafter import api
from mlx_redrafter.batch.budget import Budget, CostCurve
from mlx_redrafter.batch.loop import Batch
from mlx_redrafter.cache import KVCache
from mlx_redrafter.chat import common_prefix
from mlx_redrafter.errors import UserError
from mlx_redrafter.generate import Record, Stats
from mlx_redrafter.logprobs import TokenLogprob
from mlx_redrafter.models.tokenizer import StreamingDetokenizer
from mlx_redrafter.options import MAX_CANDIDATE_LENGTH, DecodeOptions
from mlx_redrafter.server.metrics import Metrics
from mlx_redrafter.server.protocol import ApiError, Ended
from mlx_redrafter.server.stops import StopText
from mlx_redrafter.step import prefill_logits


@dataclass
class Event:
    """What a job tells the HTTP side: text pieces with their origin, the end, or an error."""

    kind: str  # text | done | error
    pieces: list[tuple[str, str]] = field(default_factory=list)  # (text, origin: target | draft:<source>)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of the tokens this event's text came from
    prompt_logprobs: list[TokenLogprob] | None = None  # the prompt's tokens after its first (`Job.score_prompt`)
    ended: Ended | None = None  # done
    error: ApiError | None = None
    choice: int = 0  # the index of the job that sent it (`Job.index`)


class Job:
    """One completion on its way through the scheduler (a request asks for one or more); its events arrive on
    the asyncio loop that made it."""

    def __init__(self, ids: list[int], options: DecodeOptions, stop: list[str], loop: asyncio.AbstractEventLoop,
                 score_prompt: bool = False, queue: asyncio.Queue[Event] | None = None, index: int = 0):
        """`score_prompt`: the first event carries the log-probabilities of the prompt's own tokens (with
        `options.logprobs`; the whole prompt is then prefilled, never continued from a cached conversation).
        `queue`: where its events go (the jobs of one request share one), each marked with `index`."""
        self.ids, self.options, self.stop, self.score_prompt = ids, options, stop, score_prompt
        self.loop, self.index = loop, index
        self.arrived = time.monotonic()
        self.queue: asyncio.Queue[Event] = queue if queue is not None else asyncio.Queue()
        self.cancelled = threading.Event()

    def put(self, event: Event) -> None:
        event.choice = self.index
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    def cancel(self) -> None:
        """The client is gone: stop at the next turn."""
        self.cancelled.set()


class PromptCache:
    """KV caches of finished requests by the tokens they hold (LRU); a taken cache is the taker's alone."""

    def __init__(self, entries: int):
        self.entries = entries
        self.items: OrderedDict[tuple[int, ...], KVCache] = OrderedDict()

    def take(self, ids: list[int]) -> tuple[KVCache | None, int]:
        """The cache sharing the longest token prefix with `ids`, trimmed to it (at most all but the last id)."""
        best, keep = None, 0
        for key in self.items:
            n = common_prefix(key, ids)
            if n > keep:
                best, keep = key, n
        if best is None:
            return None, 0
        cache = self.items.pop(best)
        keep = min(keep, len(ids) - 1)
        cache.offset = keep  # entries past the offset are scratch: overwritten by the prefill
        return cache, keep

    def put(self, tokens: list[int], cache: KVCache) -> None:
        if self.entries <= 0:
            return
        self.items[tuple(tokens)] = cache
        self.items.move_to_end(tuple(tokens))
        while len(self.items) > self.entries:
            self.items.popitem(last=False)


class _Running:
    """A job in the batch: its text, stop strings and statistics."""

    def __init__(self, job: Job, lm: api.LoadedModel, cached: int):
        self.job, self.cached = job, cached  # prompt tokens continued from a cached conversation
        self.detok = StreamingDetokenizer(lm.tokenizer)
        self.stops = StopText(job.stop)
        self.stats = Stats()
        self.tokens: list[int] = []
        self.draft = api.draft_mode(lm, job.options).name
        self.first: Record | None = None  # the prefill's record


@dataclass
class _Shared:
    """A prompt prefilled once for several jobs: its cache (`keep` tokens of it continued from a cached
    conversation), and the logits and hidden state at its last position."""

    cache: KVCache
    keep: int
    logits: mx.array
    h: mx.array


class Scheduler:
    """Owns the loaded model on its own thread (see the module docstring)."""

    def __init__(self, lm: api.LoadedModel, max_active: int = 4, max_queued: int = 16, cache_entries: int = 4,
                 curve: CostCurve | None = None):
        self.lm, self.max_active, self.max_queued = lm, max_active, max_queued
        self.prompts = PromptCache(cache_entries)
        self.waiting: deque[Job] = deque()
        self.admitting = 0  # jobs taken from `waiting`, not yet in `active` (counted against the capacity)
        self.active: list[_Running] = []
        self.batch = Batch(lm.target.model, lm.tokenizer.eos_ids, MAX_CANDIDATE_LENGTH,
                           Budget(MAX_CANDIDATE_LENGTH, curve))
        self.wake = threading.Condition()
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="redrafter-scheduler", daemon=True)
        self.metrics = Metrics()

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        with self.wake:
            self.stopping = True
            self.wake.notify()
        self.thread.join(timeout=30)

    @property
    def capacity(self) -> int:
        """Completions running and waiting at most."""
        return self.max_active + self.max_queued

    def submit(self, *jobs: Job) -> None:
        """Queue jobs, all or none; beyond max_active running + max_queued waiting it is a 429 with Retry-After."""
        with self.wake:
            if len(self.waiting) + self.admitting + len(self.active) + len(jobs) > self.capacity:
                raise ApiError(429, f"the server is busy ({len(self.active)} completions running, "
                                    f"{len(self.waiting)} waiting): retry shortly", kind="rate_limit_error",
                               headers={"Retry-After": "1"})
            self.waiting.extend(jobs)
            self.wake.notify()

    def load(self) -> dict[str, int]:
        """Requests running and waiting."""
        with self.wake:
            return {"active": len(self.active) + self.admitting, "waiting": len(self.waiting)}

    def _run(self) -> None:
        while True:
            with self.wake:
                while not self.stopping and not self.waiting and not self.active:
                    self.wake.wait()
                if self.stopping:
                    break
                admitted = []
                while self.waiting and len(self.active) + len(admitted) < self.max_active:
                    admitted.append(self.waiting.popleft())
                self.admitting = len(admitted)
            shared = self._shared_prompts(admitted)
            for job in admitted:
                self._admit(job, shared)
            for run in list(self.active):
                if run.job.cancelled.is_set():
                    self._finish(run, "", notify=False)
            self._step()

    def _shared_prompts(self, jobs: list[Job]) -> dict[tuple[int, ...], _Shared]:
        """One prefill for each prompt that several of `jobs` start with (a request's `n` choices), continuing a
        cached conversation where one shares it; each such job joins the batch with a copy of its cache."""
        counts: dict[tuple[int, ...], int] = {}
        for job in jobs:
            if not (job.score_prompt and job.options.logprobs is not None):
                counts[tuple(job.ids)] = counts.get(tuple(job.ids), 0) + 1
        shared = {}
        for ids, count in counts.items():
            if count < 2:
                continue
            try:
                cache, keep = self.prompts.take(list(ids))
                cache = cache if cache is not None else self.lm.target.model.make_cache(len(ids) + 1)
                logits, h = prefill_logits(self.lm.target.model, cache, list(ids[keep:]))
                mx.eval(logits, h, *cache.state())
            except Exception:  # the jobs prefill alone and meet the failure there
                continue
            shared[ids] = _Shared(cache, keep, logits, h)
        return shared

    def _admit(self, job: Job, shared: dict[tuple[int, ...], _Shared]) -> None:
        """Prefill a job into the batch (its first token is its first record)."""
        run = None
        try:
            if not job.cancelled.is_set():
                run = self._start(job, shared.get(tuple(job.ids)))
            else:  # the client left while it waited
                self.metrics.ended("abort", time.monotonic() - job.arrived)
        except Exception as e:  # a failure of one request must not stop the others
            self.metrics.ended("error", time.monotonic() - job.arrived)
            job.put(Event("error", error=_failure(e)))
        finally:
            with self.wake:
                self.admitting -= 1
                if run is not None:
                    self.active.append(run)
        if run is not None:
            self._after(run, run.first)

    def _start(self, job: Job, shared: _Shared | None) -> _Running:
        """The job joined to the batch, continuing a finished request's cache where it shares the prefix, or a
        copy of a prefill it shares with other jobs (`_shared_prompts`)."""
        o = job.options
        scored = job.score_prompt and o.logprobs is not None  # a cached prefix has no logits to score it with
        if shared is not None:
            cache, keep, prefilled = shared.cache.copy(), shared.keep, (shared.logits, shared.h)
        else:
            (cache, keep), prefilled = (None, 0) if scored else self.prompts.take(job.ids), None
        run = _Running(job, self.lm, keep)
        room = self.lm.target.model.args.max_position_embeddings - len(job.ids)
        allocator = api.make_allocator(self.lm, o)
        run.first = self.batch.add(run, job.ids[keep:], max_tokens=min(o.max_tokens, room), sampling=o.sampling,
                                   allocator=allocator, cache=cache, history=job.ids[:keep],
                                   length=o.shape.length if allocator is not None else 1, logprobs=o.logprobs,
                                   score_prompt=scored, prefilled=prefilled,
                                   constraint=api.make_constraint(self.lm, o))
        self.metrics.started(len(job.ids), keep)
        return run

    def _step(self) -> None:
        """One target call for every running job."""
        try:
            records = self.batch.step()
        except Exception as e:  # the call every job shared failed: each of them gets the error
            for run in list(self.active):
                self._drop(run)
                self.metrics.ended("error", time.monotonic() - run.job.arrived)
                run.job.put(Event("error", error=_failure(e)))
            return
        if records:
            self.metrics.target_call()
        for run, record in records:
            self._after(run, record)

    def _after(self, run: _Running, record: Record) -> None:
        """Hand a job's record to its client; finish the job if it ended."""
        job = run.job
        self.metrics.record(record, time.monotonic() - job.arrived if record is run.first else None)
        run.stats.add(record)
        run.tokens.extend(record.tokens)
        pieces, hit = run.stops.add(_pieces(run.detok, record))
        if pieces or record.logprobs or record.prompt_logprobs is not None:  # a stop string's tokens too
            job.put(Event("text", pieces=pieces, logprobs=record.logprobs or [],
                          prompt_logprobs=record.prompt_logprobs))
        if hit:
            self._finish(run, "stop")
        elif record.stop:
            tail, hit = run.stops.add([(run.detok.flush(), "target")])
            rest = tail + run.stops.flush()
            if rest:
                job.put(Event("text", pieces=rest))
            self._finish(run, "stop" if hit or record.stop == "eos" else "length")

    def _drop(self, run: _Running) -> tuple[KVCache | None, list[int]]:
        """Take a job out of the batch and the active list; its cache and the tokens it holds."""
        out = self.batch.remove(run, with_cache=True) if run in self.batch.keys else (None, [])
        with self.wake:
            self.active.remove(run)
        return out

    def _finish(self, run: _Running, finish: str, notify: bool = True) -> None:
        cache, held = self._drop(run)
        if cache is not None and held:
            self.prompts.put(held, cache)
        self.metrics.ended(finish or "abort", time.monotonic() - run.job.arrived)
        if notify:
            run.job.put(Event("done", ended=Ended(finish, len(run.job.ids), len(run.tokens), run.cached, run.stats,
                                                  run.draft)))


def _failure(e: Exception) -> ApiError:
    """A request's failure as its error: a 400 for bad input, else a 500 naming the cause."""
    if isinstance(e, UserError):
        return ApiError(400, str(e))
    return ApiError(500, f"{type(e).__name__}: {e}", kind="server_error")


def _pieces(detok: StreamingDetokenizer, r: Record) -> list[tuple[str, str]]:
    """A record's text, split by origin: the accepted drafts (from `r.source`), then the target's own token."""
    n = min(r.accepted, len(r.tokens))  # a cut at the token limit may leave drafts only
    out = []
    if n:
        out.append((detok.add(r.tokens[:n]), f"draft:{r.source}"))
    if r.tokens[n:]:
        out.append((detok.add(r.tokens[n:]), "target"))
    return [(t, o) for t, o in out if t]
