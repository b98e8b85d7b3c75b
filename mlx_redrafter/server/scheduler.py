"""The scheduler: one thread owns the model and serves every active request one target call at a time.

Up to `max_active` requests run at once and `max_queued` more wait (one more is a 429), each advanced by one step
(one record of `api.decode`) per turn, round robin, so a long answer never stalls a short one for more than a
step. A request whose client went away is closed at its next turn (its cache settles, see generate.py). Finished
requests leave their KV cache in a small LRU keyed by the tokens it holds, and a request that starts with the same
tokens (the earlier turns of a conversation) continues from it: only the new tokens are prefilled.

The HTTP side never touches MLX: it hands a `Job` over and reads its events. A batched stepper (several
requests' steps in one target call) plugs in at `_turn`.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from mlx_redrafter import api
from mlx_redrafter.cache import KVCache
from mlx_redrafter.chat import common_prefix
from mlx_redrafter.errors import UserError
from mlx_redrafter.generate import Record, Stats
from mlx_redrafter.models.tokenizer import StreamingDetokenizer
from mlx_redrafter.options import DecodeOptions
from mlx_redrafter.server.protocol import ApiError, usage
from mlx_redrafter.server.stops import StopText


@dataclass
class Event:
    """What a job tells the HTTP side: text pieces with their origin, the end, or an error."""

    kind: str  # text | done | error
    pieces: list[tuple[str, str]] = field(default_factory=list)  # (text, origin: target | draft:<source>)
    finish: str = ""  # stop | length (done)
    usage: dict[str, Any] = field(default_factory=dict)
    error: ApiError | None = None


class Job:
    """One request on its way through the scheduler; its events arrive on the asyncio loop that made it."""

    def __init__(self, ids: list[int], options: DecodeOptions, stop: list[str], loop: asyncio.AbstractEventLoop):
        self.ids, self.options, self.stop = ids, options, stop
        self.loop = loop
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.cancelled = threading.Event()

    def put(self, event: Event) -> None:
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
    """A job being decoded: its records, text and statistics."""

    def __init__(self, job: Job, lm: api.LoadedModel, cache: KVCache, keep: int):
        self.job, self.cache, self.keep = job, cache, keep
        self.records = api.decode(lm, job.ids[keep:], job.options, cache=cache, history=job.ids[:keep])
        self.detok = StreamingDetokenizer(lm.tokenizer)
        self.stops = StopText(job.stop)
        self.stats = Stats()
        self.tokens: list[int] = []
        self.draft = api.draft_mode(lm, job.options).name


class Scheduler:
    """Owns the loaded model on its own thread (see the module docstring)."""

    def __init__(self, lm: api.LoadedModel, max_active: int = 4, max_queued: int = 16, cache_entries: int = 4):
        self.lm, self.max_active, self.max_queued = lm, max_active, max_queued
        self.prompts = PromptCache(cache_entries)
        self.waiting: deque[Job] = deque()
        self.admitting = 0  # jobs taken from `waiting`, not yet in `active` (counted against the capacity)
        self.active: list[_Running] = []
        self.wake = threading.Condition()
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="redrafter-scheduler", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        with self.wake:
            self.stopping = True
            self.wake.notify()
        self.thread.join(timeout=30)

    def submit(self, job: Job) -> None:
        """Queue a job; beyond max_active running + max_queued waiting it is a 429 with Retry-After."""
        with self.wake:
            if len(self.waiting) + self.admitting + len(self.active) >= self.max_active + self.max_queued:
                raise ApiError(429, f"the server is busy ({len(self.active)} requests running, {len(self.waiting)} "
                                    f"waiting): retry shortly", kind="rate_limit_error", headers={"Retry-After": "1"})
            self.waiting.append(job)
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
            for job in admitted:
                self._admit(job)
            for run in list(self.active):
                self._turn(run)
        for run in self.active:
            run.records.close()

    def _admit(self, job: Job) -> None:
        run = None
        try:
            if not job.cancelled.is_set():
                run = self._start(job)
        except Exception as e:  # a failure of one request must not stop the others
            job.put(Event("error", error=_failure(e)))
        finally:
            with self.wake:
                self.admitting -= 1
                if run is not None:
                    self.active.append(run)

    def _start(self, job: Job) -> _Running:
        """The job with its cache: a finished request's that shares its prefix, else a new one sized for the
        prompt and at most the answer the context has room for."""
        cache, keep = self.prompts.take(job.ids)
        if cache is None:
            room = self.lm.target.model.args.max_position_embeddings - len(job.ids)
            cache = self.lm.target.model.make_cache(len(job.ids) + min(job.options.max_tokens, room) + 64)
        return _Running(job, self.lm, cache, keep)

    def _turn(self, run: _Running) -> None:
        """Advance one job by one target call."""
        job = run.job
        try:
            if job.cancelled.is_set():
                self._finish(run, "", notify=False)
                return
            record = next(run.records, None)
            if record is None:
                self._finish(run, "stop")
                return
            run.stats.add(record)
            run.tokens.extend(record.tokens)
            pieces, hit = run.stops.add(_pieces(run.detok, record))
            if pieces:
                job.put(Event("text", pieces=pieces))
            if hit:
                self._finish(run, "stop")
            elif record.stop:
                tail, hit = run.stops.add([(run.detok.flush(), "target")])
                rest = tail + run.stops.flush()
                if rest:
                    job.put(Event("text", pieces=rest))
                self._finish(run, "stop" if hit or record.stop == "eos" else "length")
        except Exception as e:  # a failure of one request must not stop the others
            run.records.close()
            self._drop(run)
            job.put(Event("error", error=_failure(e)))

    def _drop(self, run: _Running) -> None:
        with self.wake:
            self.active.remove(run)

    def _finish(self, run: _Running, finish: str, notify: bool = True) -> None:
        run.records.close()  # the cache now holds the prompt and every emitted token
        self._drop(run)
        self.prompts.put(run.job.ids + run.tokens, run.cache)
        if notify:
            run.job.put(Event("done", finish=finish, usage=usage(len(run.job.ids), len(run.tokens), run.keep,
                                                                 run.stats, run.draft)))


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
