"""Continuous batching: sequences decode together, one target call per step for all of them.

`Batch` holds the rows: `add` prefills a sequence alone (in its own one-row cache, or one that already holds its
history) and splices it into the batch's `RowsCache` without recomputing the other rows; `step` advances every
row by one target call (plain when no row drafts, else speculative with each row's own draft sources, sampling
settings and the candidate length the `Budget` gives it); `remove` takes a row out, with a compact cache of what
it holds if asked (e.g. for a prompt cache). A row whose generation ended (eos, its token limit) stays until the
caller removes it (`done`); `step` refuses to run while one is there.

`generate_batch` drives a `Batch` over a list of prompts, `batch_size` rows at a time, and yields
`(index, Record)`: the prompt's index and what the call decided for that row (`Record.seconds` is the wall time of
the call every row shared). Each row emits what its prompt decoded alone would emit (greedy: identical ids;
sampling: the same distribution, each row with its own random stream, seeded with `seed + index` when the
sampling settings have a seed).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import mlx.core as mx

from mlx_redrafter.batch.budget import Budget
from mlx_redrafter.batch.cache import RowsCache
from mlx_redrafter.batch.step import Row, ar_step, speculative_step
from mlx_redrafter.cache import KVCache
from mlx_redrafter.constraint import Constraint, advance, allowed_next
from mlx_redrafter.draft.base import Allocator, DecodeState, drafting_kind, host_only, host_proposals
from mlx_redrafter.errors import UserError
from mlx_redrafter.generate import Emitter, Record
from mlx_redrafter.logprobs import Pending, of_prompt, pending
from mlx_redrafter.model import Model, forward_chunked
from mlx_redrafter.sampling import GREEDY, Rng, Sampling, recent_tokens
from mlx_redrafter.step import decide, prefill_logits


@dataclass
class _Seq:
    key: object
    emit: Emitter
    sampling: Sampling
    rng: Rng | None
    state: DecodeState
    allocator: Allocator | None
    base: int  # tokens of history + prompt
    logprobs: int | None = None  # alternatives per token when the row reports log-probabilities (logprobs.py)


class Batch:
    """The rows decoding together (see the module docstring)."""

    def __init__(self, model: Model, eos_ids: Iterable[int] = (), length: int = 4, budget: Budget | None = None):
        self.model, self.eos, self.length = model, list(eos_ids), length
        self.cache = RowsCache(model.args.num_hidden_layers, 256)
        self.budget = budget or Budget(length)
        self.seqs: list[_Seq] = []

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def keys(self) -> list[object]:
        return [s.key for s in self.seqs]

    def add(self, key: object, prompt: list[int], *, max_tokens: int, sampling: Sampling = GREEDY,
            allocator: Allocator | None = None, cache: KVCache | None = None, history: list[int] = (),
            rng: Rng | None = None, length: int | None = None, logprobs: int | None = None,
            score_prompt: bool = False, prefilled: tuple[mx.array, mx.array] | None = None,
            constraint: Constraint | None = None) -> Record:
        """Prefill `prompt` (after the `history` a passed one-row `cache` holds) and join the batch; returns the
        prefill's record (its one token). `length` caps this row's candidates (default: the batch's); with
        `logprobs` = k, every record of this row carries its tokens' log-probabilities and k alternatives each, and
        with `score_prompt` too the prefill's record carries the prompt's (`Record.prompt_logprobs`). With
        `prefilled` = (logits, hidden state) at the prompt's last position, `cache` holds the prompt too already
        (e.g. a copy of one prefill shared by several rows). With a `constraint`, the row's tokens follow its
        grammar (constraint.py). A row that is done at once (eos first, max_tokens 1) joins too: remove it like
        any finished row."""
        if not prompt:
            raise UserError("the prompt is empty: give at least one token")
        t = time.perf_counter()
        history = list(history)
        one = cache if cache is not None else self.model.make_cache(len(prompt) + 1)
        held = len(history) + (len(prompt) if prefilled is not None else 0)
        if one.offset != held:
            raise ValueError(f"the cache holds {one.offset} tokens, not the {held} of the history (and prompt)")
        rng = rng if rng is not None or sampling.greedy else Rng(sampling.seed)
        scored = score_prompt and logprobs is not None and prefilled is None
        if prefilled is not None:
            logits, h = prefilled
        elif scored:
            logits, hidden = forward_chunked(self.model, one, mx.array([prompt]), all_hidden=True)
            logits, h = logits[:, -1], hidden[:, -1]
        else:
            logits, h = prefill_logits(self.model, one, prompt)
        g0, lp = decide(logits, sampling, rng, logprobs, recent_tokens([*history, *prompt], sampling),
                        allowed_next(constraint))
        mx.eval(g0, h, *one.state(), *(lp.arrays() if lp else ()))
        prompt_lps = of_prompt(self.model, hidden, prompt, logprobs) if scored else None
        first = g0.item()
        advance(constraint, [first])
        seq = _Seq(key, Emitter(max_tokens, self.eos), sampling, rng,
                   DecodeState(tokens=[*history, *prompt, first], g0=g0.astype(mx.int32), h=h,
                               constraint=constraint), allocator,
                   len(history) + len(prompt), logprobs)
        tokens = seq.emit([first])
        self.cache.join(one)
        mx.eval(*self.cache.state())  # the copy into the batch's cache is the join's cost, not the next step's
        cap = min(length or self.length, self.length)
        self.budget.join(cap, allocator.longest(cap) if allocator is not None else None)
        if allocator is not None:
            for src in allocator.sources:
                src.start(seq.state.tokens)
        self.seqs.append(seq)
        return Record(tokens=tokens, decided=1, seconds=time.perf_counter() - t, prefill=len(prompt),
                      stop=seq.emit.stop, logprobs=None if lp is None else lp.host(len(tokens)),
                      prompt_logprobs=prompt_lps)

    def done(self) -> list[object]:
        """The rows whose generation ended (remove them before the next step)."""
        return [s.key for s in self.seqs if s.emit.done]

    def remove(self, key: object, with_cache: bool = False) -> tuple[KVCache | None, list[int]]:
        """Take a row out. With `with_cache`, a one-row cache of what it holds and the tokens it holds (history,
        prompt and the emitted tokens its cache has: all but the last when that one was never fed)."""
        r = self.keys.index(key)
        seq = self.seqs[r]
        held = (seq.state.tokens[: seq.base] + seq.emit.emitted)[: self.cache.lengths[r]]
        out = self.cache.extract(r, len(held)) if with_cache else None
        self._keep([i for i in range(len(self.seqs)) if i != r])
        return out, held

    def _keep(self, rows: list[int]) -> None:
        self.seqs = [self.seqs[i] for i in rows]
        self.cache.select(rows)
        self.budget.select(rows)

    def step(self) -> list[tuple[object, Record]]:
        """One target call for every row; returns each row's record."""
        if not self.seqs:
            return []
        if self.done():
            raise RuntimeError(f"internal error: finished rows {self.done()} are still in the batch")
        t = time.perf_counter()
        seqs = self.seqs
        plans = [s.allocator.plan() if s.allocator is not None else [] for s in seqs]
        host = host_proposals(plans, [s.state for s in seqs], self.budget.caps)  # copies first: they price the step
        lengths = self.budget.lengths([drafting_kind(p, h) for p, h in zip(plans, host)],
                                      [not s.sampling.greedy for s in seqs],
                                      [max(c.shape[1] for c in h.values()) if host_only(p, h) else None
                                       for p, h in zip(plans, host)])
        if max(lengths) <= 1:
            (decided, logprobs), results = self._plain(seqs), None
        else:
            capped = self.budget.caps_candidates
            rows = [Row(s.state, plan if n > 1 else [], n, s.rng, s.sampling, capped and s.sampling.greedy,
                        s.logprobs) for s, plan, n in zip(seqs, plans, lengths)]
            results = speculative_step(self.model, self.cache, rows,
                                       [h if n > 1 else {} for h, n in zip(host, lengths)])
            decided, logprobs = [res.tokens for res in results], [res.logprobs for res in results]
            for s, res in zip(seqs, results):
                s.state.g0, s.state.h = res.g0, res.h
        for i, (s, d) in enumerate(zip(seqs, decided)):
            s.state.tokens.extend(d)
            advance(s.state.constraint, d)
            if s.allocator is not None:
                for src in s.allocator.sources:
                    src.extend(d)
                if results is not None:
                    s.allocator.update(results[i].runs)
        seconds = time.perf_counter() - t
        accepted = [0] * len(seqs) if results is None else [res.accepted for res in results]
        drafted = lengths if results is None else [min(n, res.longest) for n, res in zip(lengths, results)]
        self.budget.observe(drafted, accepted, seconds)
        out = []
        for i, (s, d, lp) in enumerate(zip(seqs, decided, logprobs)):
            tokens = s.emit(d)
            lps = None if lp is None else lp.host(len(tokens))
            if results is None:
                out.append((s.key, Record(tokens=tokens, decided=1, seconds=seconds, verified=1, stop=s.emit.stop,
                                          logprobs=lps)))
            else:
                res = results[i]
                out.append((s.key, Record(tokens=tokens, decided=len(d), seconds=seconds, accepted=res.accepted,
                                          verified=res.verified, candidates=res.candidates, runs=res.runs,
                                          source=res.source, proposed=res.proposed, stop=s.emit.stop,
                                          logprobs=lps)))
        return out

    def _plain(self, seqs: list[_Seq]) -> tuple[list[list[int]], list[Pending | None]]:
        """One plain step for every row: the token each decided, and its log-probabilities where asked for."""
        g0 = mx.concatenate([s.state.g0 for s in seqs])
        nxt, hidden, logits = ar_step(self.model, self.cache, g0, [s.sampling for s in seqs], [s.rng for s in seqs],
                                      [s.state.tokens for s in seqs], [s.state.constraint for s in seqs])
        lps = [None if s.logprobs is None else pending(logits[r : r + 1], nxt[r : r + 1], s.logprobs)
               for r, s in enumerate(seqs)]
        mx.eval(nxt, hidden, *(a for lp in lps if lp for a in lp.arrays()))
        decided = [[x] for x in nxt.tolist()]
        for r, s in enumerate(seqs):
            s.state.g0, s.state.h = nxt[r : r + 1], hidden[r : r + 1]
        return decided, lps


def generate_batch(model: Model, prompts: Iterable[list[int]], *, batch_size: int, max_tokens: int = 256,
                   eos_ids: Iterable[int] = (), sampling: Sampling = GREEDY,
                   allocator: Callable[[], Allocator | None] = lambda: None, length: int = 4,
                   budget: Budget | None = None, logprobs: int | None = None,
                   constraint: Callable[[], Constraint | None] = lambda: None) -> Iterator[tuple[int, Record]]:
    """Decode every prompt, `batch_size` at a time (see the module docstring). `allocator()` builds one row's
    draft sources (None: plain decoding); `length` is the longest candidate a row drafts (g0 included);
    `logprobs` as in `Batch.add`; `constraint()` builds one row's grammar (None: none)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise UserError(f"--batch-size must be an integer >= 1 (got {batch_size!r})")
    pending = deque(enumerate(prompts))
    batch = Batch(model, eos_ids, length, budget)
    while pending or len(batch):
        while pending and len(batch) < batch_size:
            index, prompt = pending.popleft()
            rng = None if sampling.greedy else Rng(None if sampling.seed is None else sampling.seed + index)
            yield index, batch.add(index, prompt, max_tokens=max_tokens, sampling=sampling, allocator=allocator(),
                                   rng=rng, logprobs=logprobs, constraint=constraint())
            if batch.done():
                batch.remove(index)
        yield from batch.step()
        for key in batch.done():
            batch.remove(key)
