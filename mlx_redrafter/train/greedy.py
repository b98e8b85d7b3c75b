"""Self-distillation: the target's own greedy answers to the plan's prompts, generated in batches.

`GreedyRows` is the engine (the runtime's own model and dtype; rows with their own positions and masks in one KV
cache, groups of prompts joining as rows finish); `generate_greedy` answers one batch of prompts with it;
`GreedySource` turns the plan (`plan.py`) into shards for `distill.grow`, making the later turn-2 passes over the
same sequences together (`companions`, `make_group`).
"""

from __future__ import annotations

import hashlib
import io
import time
import zipfile
from collections import Counter, deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlx_redrafter.batch.cache import RowsCache
from mlx_redrafter.batch.step import ar_step
from mlx_redrafter.errors import UserError
from mlx_redrafter.files import write_atomic
from mlx_redrafter.model import Model, forward_chunked
from mlx_redrafter.models.loader import Target
from mlx_redrafter.sampling import GREEDY
from mlx_redrafter.train.batch import left_padded
from mlx_redrafter.train.corpus import Corpus, load_shard, sha256_file
from mlx_redrafter.train.distill import Made, partial_path, partial_states_path
from mlx_redrafter.train.plan import FOLLOW_UPS, LICENSES, Job, Settings, follow_choice, plan_jobs, plan_order

ROOM = 256  # free slots the running cache keeps after its rows' entries when a group joins


class GreedyRows:
    """Sequences decoding greedily together in one `RowsCache`, to which groups of prompts can be added while
    others run (so that a batch stays full while its rows finish at different lengths).

    `add` prefills a group of prompts (and the branches that continue them: `generate_greedy`) in a cache of its
    own and joins its rows to the running ones (`RowsCache.join_rows`: left padding and the empty slots of a short
    suffix stay masked). `step` feeds every row its last token (`batch.step.ar_step`); a row stops at an eos id or
    after `max_new_tokens` tokens. Each row keeps its own positions and the slots it may attend to, so a row decides
    what it would alone. Finished rows leave the cache once fewer than `compact_below` of its rows still run, or
    before a group joins. With `capture`, each decided token's state is kept: the post-norm state, followed by the
    states of target layers `layers` where given (what a drafter fusing them trains on, `Model.tapping`).
    """

    def __init__(self, model: Model, max_new_tokens: int, eos_ids: list[int], capture: bool = False,
                 compact_below: float = 0.75, layers: tuple[int, ...] = ()):
        if not eos_ids:
            raise UserError("the target tokenizer has no eos id: cannot pad or stop generations")
        self.model, self.max_new, self.eos_ids, self.capture = model, max_new_tokens, list(eos_ids), capture
        self.layers = tuple(layers) if capture else ()
        self.eos, self.compact_below = set(eos_ids), compact_below
        self.cache = RowsCache(model.args.num_hidden_layers, 0)
        self.keys: list[object] = []  # per cache row: its key
        self.nxt = mx.zeros((0,), dtype=mx.int32)
        self.h = mx.zeros((0, model.args.hidden_size * (1 + len(self.layers))), dtype=mx.float16)
        self.out: dict[object, list[int]] = {}
        self.hids: dict[object, list[np.ndarray]] = {}
        self.running: dict[object, bool] = {}

    @property
    def live(self) -> int:
        """Rows still generating."""
        return sum(self.running[k] for k in self.keys)

    def finished(self, key: object) -> bool:
        """Whether the row under `key` has stopped (eos or its token limit)."""
        return key in self.running and not self.running[key]

    def result(self, key: object) -> tuple[list[int], np.ndarray | None]:
        """A finished row's response (and its hidden states with `capture`), handed over once."""
        out, hids = self.out.pop(key), self.hids.pop(key)
        return out, (np.stack(hids[: len(out)]) if self.capture else None)

    def add(self, prompts: list[list[int]], branches: list[tuple[int, list[int]]], keys: list[object],
            room: int = ROOM) -> None:
        """Prefill `prompts` and start a row per branch (i, suffix): prompts[i] + suffix, under its key. The cache
        keeps `room` free slots after its rows' entries (it grows, for a moment twice its size, when the rows
        outlast them)."""
        model, pad_id = self.model, self.eos_ids[0]
        self._compact()
        B = len(branches)
        tok, positions, mask, pad = left_padded(prompts, pad_id)
        n_pad = tok.shape[1]
        S = max(len(s) for _, s in branches)
        cache = model.make_cache(n_pad + S)
        with self._tapping():
            logits, hidden = forward_chunked(model, cache, mx.array(tok), mx.array(positions), mx.array(mask))
        of = np.array([i for i, _ in branches])
        lens = np.array([len(prompts[i]) + len(s) for i, s in branches])
        pad = pad[of]
        hole = np.array([S - len(s) for _, s in branches])  # empty slots at the start of a row's suffix block
        nxt, h = mx.argmax(logits[:, -1], axis=-1), hidden[:, -1]
        if of.tolist() != list(range(len(prompts))):  # a cache row per branch
            idx = mx.array(of)
            cache.select(idx)
            nxt, h = nxt[idx], h[idx]
        cols = np.arange(n_pad + S)
        in_hole = (cols[None, :] >= n_pad) & (cols[None, :] < n_pad + hole[:, None])
        key_ok = (cols[None, :] >= pad[:, None]) & ~in_hole  # (B, n_pad + S): each row's own entries
        if S:
            block = np.full((B, S), pad_id, dtype=np.int32)
            for b, (_, s) in enumerate(branches):
                block[b, hole[b]:] = s
            q = np.arange(S)
            sees = key_ok[:, None, :] & (cols[None, None, :] <= n_pad + q[None, :, None])
            sees[:, q, n_pad + q] = True  # an empty slot's query sees itself
            pos = np.maximum((lens - S)[:, None] + q[None, :], 0)
            with self._tapping():
                logits, hidden = forward_chunked(model, cache, mx.array(block), mx.array(pos, dtype=mx.int32),
                                                 mx.array(sees[:, None]))
            fed = mx.array(hole < S)  # rows whose suffix is not empty take their first token from it
            nxt = mx.where(fed, mx.argmax(logits[:, -1], axis=-1), nxt)
            h = mx.where(fed[:, None], hidden[:, -1], h)
        self.cache.join_rows(cache, key_ok, lens.tolist(), room)
        self.keys += list(keys)
        self.nxt = mx.concatenate([self.nxt, nxt.astype(mx.int32)])
        self.h = mx.concatenate([self.h, self._state(h)])
        for k in keys:
            self.out[k], self.hids[k], self.running[k] = [], [], True
        self._take(list(range(len(self.keys) - B, len(self.keys))))

    def step(self) -> None:
        """One forward for every row (finished rows still in the cache included): each running row decides its
        next token."""
        live = self.live
        if not live:
            return
        if live < self.compact_below * len(self.keys):
            self._compact()
        B = len(self.keys)
        with self._tapping():
            nxt, h, _ = ar_step(self.model, self.cache, self.nxt, [GREEDY] * B, [None] * B)
        self.nxt, self.h = nxt.astype(mx.int32), self._state(h)
        self._take([i for i, k in enumerate(self.keys) if self.running[k]])

    def _tapping(self):
        """The target's forwards here return the layers kept with `capture` (else what the model is set to)."""
        return self.model.tapping(self.layers or self.model.feature_layers)

    def _state(self, hidden: mx.array) -> mx.array:
        """What is kept of a forward's states (float16): the post-norm state (+ the tapped layers')."""
        return (hidden if self.layers else self.model.last_state(hidden)).astype(mx.float16)

    def _take(self, rows: list[int]) -> None:
        """Record the tokens (and states) just decided for these cache rows."""
        if self.capture:
            mx.eval(self.nxt, self.h)
            h = np.array(self.h)
        new = self.nxt.tolist()
        for i in rows:
            k = self.keys[i]
            self.out[k].append(new[i])
            if self.capture:
                self.hids[k].append(h[i])
            self.running[k] = new[i] not in self.eos and len(self.out[k]) < self.max_new

    def _compact(self) -> None:
        """Drop the finished rows from the cache (and the leading slots no remaining row uses)."""
        keep = [i for i, k in enumerate(self.keys) if self.running[k]]
        if len(keep) == len(self.keys):
            return
        self.cache.select(keep, share=0.0)  # long rows: every 64 dead leading slots cost each step more
        self.keys = [self.keys[i] for i in keep]
        idx = mx.array(keep, dtype=mx.int32)
        self.nxt, self.h = (self.nxt[idx], self.h[idx]) if keep else (self.nxt[:0], self.h[:0])


def generate_greedy(model: Model, prompts: list[list[int]], max_new_tokens: int, eos_ids: list[int],
                    compact_below: float = 0.75, capture: bool = False,
                    branches: list[tuple[int, list[int]]] | None = None, layers: tuple[int, ...] = (),
                    ) -> tuple[list[list[int]], list[np.ndarray] | None]:
    """Greedy responses for a batch of prompts (each ends with an eos id if the model stopped by itself), and
    with `capture` the post-norm hidden states (float16) at each response's context positions: the last
    prompt position and every response position but the last (m states for m response tokens); with `layers`,
    each followed by those target layers' states (m, H * (1 + len(layers))).

    With `branches` [(i, suffix), ...], one response per branch instead: to prompts[i] + suffix. Each prompt is
    prefilled once however many branches continue it (e.g. several follow-up requests to one conversation), then
    its cache row is copied per branch and the suffixes are fed together (right-aligned in one block after the
    prompts). Left padding with the model's own eos id (never a real token as padding); see `GreedyRows`.
    """
    if branches is None:
        branches = [(i, []) for i in range(len(prompts))]
    rows = GreedyRows(model, max_new_tokens, eos_ids, capture, compact_below, layers)
    rows.add(prompts, branches, list(range(len(branches))), room=max_new_tokens)
    while rows.live:
        rows.step()
    results = [rows.result(b) for b in range(len(branches))]
    return [o for o, _ in results], ([h for _, h in results] if capture else None)


class Partial:
    """The finished batches of shard `name` of a corpus being made, so that an interrupted `distill` resumes inside
    the shard instead of starting it again (greedy answers are deterministic: a resumed shard equals an uninterrupted
    one). Two files (`distill.partial_path`, `partial_states_path`): the answers' token ids with what their batches cost
    (wall and CPU seconds, so that the shard's manifest entry counts the time before the interruption), committed
    with the corpus; with `capture`, the hidden states beside them, local. Both are keyed by the prompts and
    settings; one that does not match (or does not load) is ignored and overwritten. Answers whose states are
    missing (another machine made them) resume without states: the shard then carries none, and its features are
    rebuilt by the teacher-forced pass. The states file is keyed by the tapped `layers` too (its width)."""

    def __init__(self, corpus: Corpus, name: str, prompts: list[list[int]], max_new_tokens: int, capture: bool,
                 layers: tuple[int, ...] = ()):
        h = hashlib.sha256(f"{max_new_tokens}:{capture}:".encode())
        for p in prompts:
            h.update(np.asarray(p, dtype=np.int64).tobytes() + b"|")
        self.path, self.states_path = partial_path(corpus, name), partial_states_path(corpus, name)
        self.key, self.capture = h.hexdigest(), capture
        self.states_key = self.key + "".join(f":{i}" for i in layers)

    def load(self) -> tuple[dict[int, list[int]], dict[int, np.ndarray], tuple[float, float]]:
        """The saved responses, the hidden states saved with them (with `capture`, where present) and the (wall,
        CPU) seconds their batches cost."""
        z = self._read(self.path, ("index", "offsets", "tokens", "spent"), self.key)
        if z is None:
            return {}, {}, (0.0, 0.0)
        idx, offsets, tokens = z["index"].tolist(), z["offsets"], z["tokens"]
        responses = {i: tokens[offsets[k]:offsets[k + 1]].tolist() for k, i in enumerate(idx)}
        spent = (float(z["spent"][0]), float(z["spent"][1]))
        hiddens = {}
        states = self._read(self.states_path, ("index", "offsets", "hidden"), self.states_key) if self.capture else None
        if states is not None:
            s_offsets, hidden = states["offsets"], states["hidden"]
            hiddens = {i: hidden[s_offsets[k]:s_offsets[k + 1]] for k, i in enumerate(states["index"].tolist())
                       if i in responses and s_offsets[k + 1] - s_offsets[k] == len(responses[i])}
        return responses, hiddens, spent

    def _read(self, path: Path, names: tuple[str, ...], key: str) -> dict[str, np.ndarray] | None:
        """A file's arrays if it exists, loads, has `key` and the arrays `names` with consistent lengths."""
        try:
            with np.load(path, allow_pickle=False) as z:
                arrays = {k: z[k] for k in z.files}
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
            return None
        if str(arrays.get("key")) != key or any(k not in arrays for k in names):
            return None
        offsets, rows = arrays["offsets"], arrays.get("tokens", arrays.get("hidden"))
        if len(offsets) != len(arrays["index"]) + 1 or offsets[-1] != len(rows) or (np.diff(offsets) < 0).any():
            return None
        return arrays

    def save(self, responses: dict[int, list[int]], hiddens: dict[int, np.ndarray],
             spent: tuple[float, float] = (0.0, 0.0)) -> None:
        idx = sorted(responses)
        offsets = np.cumsum([0] + [len(responses[i]) for i in idx])
        buf = io.BytesIO()
        np.savez_compressed(buf, key=np.array(self.key), index=np.array(idx, dtype=np.int64), offsets=offsets,
                            tokens=np.array([t for i in idx for t in responses[i]], dtype=np.int32),
                            spent=np.array(spent, dtype=np.float64))
        write_atomic(self.path, buf.getvalue())
        have = [i for i in idx if i in hiddens]
        if self.capture and have:
            buf = io.BytesIO()
            np.savez(buf, key=np.array(self.states_key), index=np.array(have, dtype=np.int64),
                     offsets=np.cumsum([0] + [len(hiddens[i]) for i in have]),
                     hidden=np.concatenate([hiddens[i] for i in have]))
            write_atomic(self.states_path, buf.getvalue())


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


# Turn-2 shards over the same sequences made together (`GreedySource.companions`): their prompts share everything
# but the follow-up request, so a group of 5 prefills each turn-1 sequence once instead of 5 times. 5: the 9 later
# passes over a group's sequences then make two groups (5 + 4), none left alone; a group lands in ~15 minutes.
SIBLINGS = 5
# Rows of a unit that joins a running batch (`GreedySource.make_group`): a unit joins once as many rows have finished.
JOIN_ROWS = 16


class GreedySource:
    """The target's greedy answers to a JSONL prompts file, in the plan's order (see plan.py)."""

    kind = "greedy"

    def __init__(self, target: Target, prompts_file: str | Path, settings: Settings | None = None,
                 capture: bool = False, layers: tuple[int, ...] = ()):
        from mlx_redrafter.prompts import read_prompts

        self.target, self.settings, self.capture = target, settings or Settings(), capture
        self.layers = tuple(layers)  # target layers whose states are kept beside the last one (with `capture`)
        self.prompts_file = Path(prompts_file)
        self.rows = read_prompts(prompts_file)
        self.order = plan_order(self.rows, self.settings.seed)
        self._follow_ids: list[list[int]] | None = None

    def identity(self) -> dict[str, Any]:
        return {"settings": vars(self.settings), "prompts_file": self.prompts_file.name,
                "prompts_sha256": sha256_file(self.prompts_file), "licenses": LICENSES,
                "engine": "MLX batched greedy, the runtime's own model (mlx_redrafter.train.greedy.generate_greedy)"}

    def checked_keys(self) -> tuple[str, ...]:
        return ("settings", "prompts_sha256")

    def jobs(self) -> list[Job]:
        return plan_jobs(len(self.order), self.settings)

    def total(self, job: Job) -> int:
        return len(job.rows)

    def ready(self, job: Job, corpus: Corpus) -> str | None:
        if job.turn == 2 and any(corpus.check(f"shard-{p:05d}.npz") for p in job.parents):
            return "its turn-1 shards are not all there yet (another worker?)"
        return None

    def make(self, job: Job, corpus: Corpus, progress: Callable[[int, int], None]) -> Made:
        s, tok = self.settings, self.target.tokenizer
        if job.turn == 1:
            ids = [tok.encode_chat([{"role": "user", "content": self.rows[self.order[r]]["prompt"]}])
                   for r in job.rows]
        else:
            ids = self.turn2_prompts(corpus, job, set(tok.eos_ids))
        keep = [i for i, x in enumerate(ids) if x is not None and 0 < len(x) <= s.max_prompt_tokens]
        if len(keep) < len(job.rows):  # skipped rows count now, so the bar's ETA is that of the answers to make
            progress(len(job.rows) - len(keep), 0)
        prompts = [ids[i] for i in keep]
        by_len = np.argsort([len(p) for p in prompts], kind="stable")  # similar lengths batch together
        saved = Partial(corpus, job.name, prompts, s.max_new_tokens, self.capture, self.layers)
        responses, hiddens, (wall0, cpu0) = saved.load()
        t0, c0 = time.perf_counter(), time.process_time()
        for b in range(0, len(by_len), s.batch_size):
            part = [int(i) for i in by_len[b:b + s.batch_size]]
            if all(i in responses for i in part):  # made before an interruption
                progress(len(part), 0)
                continue
            outs, hid = self.answer([prompts[i] for i in part])
            for k, (i, o) in enumerate(zip(part, outs)):
                responses[i] = o
                if hid is not None:
                    hiddens[i] = hid[k]
            saved.save(responses, hiddens, (wall0 + time.perf_counter() - t0, cpu0 + time.process_time() - c0))
            progress(len(part), sum(len(o) for o in outs))
        return self._made(job, prompts, keep, responses, hiddens, (wall0, cpu0))

    def _made(self, job: Job, prompts: list[list[int]], keep: list[int], responses: dict[int, list[int]],
              hiddens: dict[int, np.ndarray], resumed: tuple[float, float], made_with: list[str] | None = None) -> Made:
        """A job's `Made` from its kept prompts (rows `keep` of the job) and their responses."""
        eos = self.target.tokenizer.eos_ids
        index = [job.rows[i] for i in keep]
        sources = Counter(self.rows[self.order[r]].get("source", "") for r in index)
        return Made(
            seqs=[prompts[i] + responses[i] for i in range(len(prompts))], prompt_lens=[len(p) for p in prompts],
            index=index, turns=job.turn,
            hidden=[hiddens[i] for i in range(len(prompts))] if self.capture and len(hiddens) == len(prompts) else None,
            layers=self.layers,
            info={"skipped_prompts": len(job.rows) - len(keep), "sources": dict(sorted(sources.items())),
                  "eos_stops": sum(1 for r in responses.values() if r and r[-1] in eos),
                  **({"made_with": made_with} if made_with else {}),
                  **({"resumed_seconds": round(resumed[0], 3), "resumed_cpu_seconds": round(resumed[1], 3)}
                     if resumed[0] else {})})

    def companions(self, job: Job, todo: list[Job]) -> list[Job]:
        """The jobs of `todo` to make together with `job`: up to SIBLINGS - 1 later turn-2 passes over the same
        sequences (the same group and part in later cycles of the plan), whose prompts differ only in the
        follow-up request: each turn-1 sequence is then prefilled once for all of them (`make_group`)."""
        if job.turn != 2:
            return []
        return [j for j in todo if j.index > job.index and j.turn == 2 and j.parents == job.parents
                and j.rows == job.rows][: SIBLINGS - 1]

    def make_group(self, jobs: list[Job], corpus: Corpus, progress: Callable[[int, int], None]) -> list[Made]:
        """`make` for turn-2 jobs over the same rows (`companions`): the same sequences as each job made alone
        (up to float rounding), each turn-1 sequence prefilled once for every job's follow-up. Units of up to
        JOIN_ROWS rows join the running batch (`GreedyRows`) whenever that many of its rows have finished, so the
        batch stays full until the last unit. Each job keeps its own partial file; `info["made_with"]` names the
        group (its cost is shared)."""
        if len(jobs) == 1:
            return [self.make(jobs[0], corpus, progress)]
        if any(j.turn != 2 or j.rows != jobs[0].rows or j.parents != jobs[0].parents for j in jobs):
            raise ValueError("make_group takes turn-2 jobs over the same rows")
        s, tok = self.settings, self.target.tokenizer
        parts = [self.turn2_parts(corpus, j, set(tok.eos_ids)) for j in jobs]
        keep = [[i for i, x in enumerate(p) if x is not None and 0 < len(x[0]) + len(x[1]) <= s.max_prompt_tokens]
                for p in parts]
        slot = [{i: k for k, i in enumerate(kept)} for kept in keep]  # row position -> index among a job's prompts
        skipped = sum(len(j.rows) - len(kept) for j, kept in zip(jobs, keep))
        if skipped:  # counted now (prompts too long with their turn-1 answer), so the bar's ETA is the answers'
            progress(skipped, 0)
        saved = [Partial(corpus, j.name, [parts[g][i][0] + parts[g][i][1] for i in kept], s.max_new_tokens,
                         self.capture, self.layers) for g, (j, kept) in enumerate(zip(jobs, keep))]
        loaded = [sv.load() for sv in saved]
        responses, hiddens = [x[0] for x in loaded], [x[1] for x in loaded]
        t0, c0 = time.perf_counter(), time.process_time()
        share = [x[2] for x in loaded]  # each job's (wall, CPU) seconds before this run
        prefix = {i: parts[g][i][0] for g in range(len(jobs)) for i in keep[g]}
        units, cur, width = [], [], 0  # row positions, shortest prefixes first, <= JOIN_ROWS branches a unit
        for i in sorted(prefix, key=lambda i: (len(prefix[i]), i)):
            n = sum(i in sl for sl in slot)
            if cur and width + n > min(JOIN_ROWS, s.batch_size):
                units.append(cur)
                cur, width = [], 0
            cur.append(i)
            width += n
        if cur:
            units.append(cur)
        pending = deque()
        for rows in units:
            branches = [(g, i) for i in rows for g in range(len(jobs)) if i in slot[g]]
            todo = [(g, i) for g, i in branches if slot[g][i] not in responses[g]]  # others: made before a stop
            progress(len(branches) - len(todo), 0)
            if todo:
                needed = {i for _, i in todo}
                rows = [i for i in rows if i in needed]
                pending.append((rows, todo))

        def save() -> None:
            spent = ((time.perf_counter() - t0) / len(jobs), (time.process_time() - c0) / len(jobs))
            for g, sv in enumerate(saved):
                sv.save(responses[g], hiddens[g], (share[g][0] + spent[0], share[g][1] + spent[1]))

        # continuous batching: a unit joins the running rows as soon as there is room for it
        running = GreedyRows(self.target.model, s.max_new_tokens, tok.eos_ids, self.capture, layers=self.layers)
        waiting, unsaved = [], 0
        try:
            while pending or running.live:
                while pending and (not running.live or running.live + len(pending[0][1]) <= s.batch_size):
                    rows, branches = pending.popleft()
                    running.add([prefix[i] for i in rows], [(rows.index(i), parts[g][i][1]) for g, i in branches],
                                branches)
                    waiting.append(branches)
                running.step()
                for branches in [b for b in waiting if all(running.finished(key) for key in b)]:
                    waiting.remove(branches)
                    for g, i in branches:
                        responses[g][slot[g][i]], hid = running.result((g, i))
                        if hid is not None:
                            hiddens[g][slot[g][i]] = hid
                    unsaved += len(branches)
                    progress(len(branches), sum(len(responses[g][slot[g][i]]) for g, i in branches))
                if unsaved >= s.batch_size or (unsaved and not (pending or running.live)):
                    save()
                    unsaved = 0
        except KeyboardInterrupt:  # stopped (Ctrl-C, SIGTERM: cmd.common.stops_cleanly): keep what is finished
            if unsaved:
                save()
            raise
        names = [j.name for j in jobs]
        return [self._made(j, [parts[g][i][0] + parts[g][i][1] for i in keep[g]], keep[g], responses[g], hiddens[g],
                           share[g], names) for g, j in enumerate(jobs)]

    def answer(self, prompts: list[list[int]]) -> tuple[list[list[int]], list[np.ndarray] | None]:
        """Greedy responses to a batch of prompts (and their hidden states when capturing)."""
        return generate_greedy(self.target.model, prompts, self.settings.max_new_tokens, self.target.tokenizer.eos_ids,
                               capture=self.capture, layers=self.layers)

    @property
    def follow_ids(self) -> list[list[int]]:
        """Token ids of each follow-up request (`follow_up_suffix` of FOLLOW_UPS)."""
        if self._follow_ids is None:
            self._follow_ids = [follow_up_suffix(self.target, t) for t in FOLLOW_UPS]
        return self._follow_ids

    def follow_choice(self, row: int, follow_pass: int = 0) -> int:
        """Which follow-up the turn-2 sequence of plan row `row` asks in a pass (`plan.follow_choice`)."""
        return follow_choice(row, follow_pass, self.settings)

    def turn2_prompts(self, corpus: Corpus, job: Job, eos: set[int]) -> list[list[int] | None]:
        """Turn-2 prompts: the turn-1 sequence of each picked row + a follow-up; None where the first answer did
        not end with eos (cut at max_new_tokens) or is missing."""
        return [None if x is None else x[0] + x[1] for x in self.turn2_parts(corpus, job, eos)]

    def turn2_parts(self, corpus: Corpus, job: Job, eos: set[int]) -> list[tuple[list[int], list[int]] | None]:
        """`turn2_prompts` as (the turn-1 sequence, the follow-up's ids) per row."""
        by_row: dict[int, np.ndarray] = {}
        for parent in job.parents:
            name = f"shard-{parent:05d}.npz"
            problem = corpus.check(name)
            if problem is not None:
                raise UserError(f"turn-2 {job.name} needs {corpus.root / name}, which is {problem}")
            sh = load_shard(corpus.root / name, self.target.model.args.vocab_size)
            for i, r in enumerate(sh.prompt_index.tolist()):
                seq = sh.sequence(i)
                if len(seq) > sh.prompt_len[i] and int(seq[-1]) in eos:
                    by_row[r] = seq
        out: list[tuple[list[int], list[int]] | None] = []
        for r in job.rows:
            seq = by_row.get(r)
            out.append(None if seq is None else (seq.tolist(), self.follow_ids[self.follow_choice(r, job.follow_pass)]))
        return out
