"""`make fuzz`: a long randomised exactness sweep (excluded from `make test`; run it before a release).

Random (drafter seed, drafter shape, W, L, lookup width and index, prompt, length) cases, greedy fp32, some with a
drafter that fuses target layers (the target then returns them; plain drafters also run on such a target):
speculative output must equal AR output, or differ only on a proven numerical tie (tests/exactness.py).
Set FUZZ_CASES (default 1000) and FUZZ_SEED. Prints a one-line summary per 50 cases and at the end.
"""

import os
import random
import time

import pytest
from exactness import ar_tokens, divergence, speculative_tokens

from mlx_redrafter.api import answer_table
from mlx_redrafter.draft.base import Allocator, Slot
from mlx_redrafter.draft.lookup import AnswerIndex, LookupSource, NgramIndex, SuffixIndex
from mlx_redrafter.draft.redrafter import RnnSource, random_drafter

pytestmark = pytest.mark.fuzz
TAPS = (2, 15, 24)  # the target layers a fused drafter reads


@pytest.fixture()
def model(target):
    """The session's model, its feature_layers restored after the test."""
    try:
        yield target.model
    finally:
        target.model.feature_layers = ()


def test_random_cases_never_diverge(target, model, chat_ids):
    n_cases = int(os.environ.get("FUZZ_CASES", "1000"))
    rng = random.Random(int(os.environ.get("FUZZ_SEED", "0")))
    tok = target.tokenizer
    extra = [tok.encode_chat([{"role": "user", "content": p}]) for p in (
        "Repeat after me: one two three one two three one two three.", "Say hello.", "List the numbers 1 to 20.")]
    prompts = chat_ids + extra
    table = answer_table(target)
    drafters: dict = {}
    ar_cache: dict = {}
    ties = failures = 0
    t0 = time.time()
    for case in range(n_cases):
        seed = rng.randrange(8)
        shape = rng.choice([(128, 4096, ()), (576, None, ()), (64, 1024, ()), (128, 4096, TAPS)])
        if (seed, shape) not in drafters:
            drafters[(seed, shape)] = random_drafter(576, 49152, seed=seed, exit_dim=shape[0],
                                                     draft_vocab_size=shape[1], feature_layers=list(shape[2]) or None)
        drafter = drafters[(seed, shape)]
        model.feature_layers = shape[2] or (TAPS if rng.random() < 0.2 else ())
        W, L, K = rng.choice([1, 2, 3, 4, 8]), rng.randint(2, 7), rng.choice([0, 0, 1, 2, 3])
        p_idx, n_tok = rng.randrange(len(prompts)), rng.choice([8, 16, 24])
        index = rng.choice([NgramIndex, SuffixIndex])
        rows = rng.choice([0, 64, 512]) if shape[1] else 0  # --drafter-vocab: the head cut to its first rows
        grow = rng.choice([0, 0, 9, 17])  # --lookup-max-length: copies grow while fully accepted
        backup = K > 0 and rng.random() < 0.3  # lookup-else-rnn: the drafter only where lookup has nothing
        cut = rng.choice([0, 0, 1e-6, 1e-3])  # --draft-confidence (a random head's tokens have p ~ 1e-4)
        rnn = Slot(RnnSource(drafter, model.embed, rows, cut), W, backs_up="lookup" if backup else None)
        slots = [] if rng.random() < 0.15 and K or backup else [rnn]
        if K:
            slots.append(Slot(LookupSource(index, max_length=grow), K))
            if rng.random() < 0.5:  # the answer table, backing up context lookup
                slots.append(Slot(LookupSource(lambda: AnswerIndex(table), "answers"), rng.choice([1, 2]),
                                  backs_up="lookup"))
        slots += [rnn] if backup else []
        alloc = Allocator(slots, adaptive=rng.random() < 0.5)
        key = (p_idx, n_tok)
        if key not in ar_cache:
            ar_cache[key] = ar_tokens(model, prompts[p_idx], n_tok, tok.eos_ids)
        got, _ = speculative_tokens(model, prompts[p_idx], alloc, L, n_tok, tok.eos_ids)
        if got != ar_cache[key]:
            problem = divergence(model, prompts[p_idx], ar_cache[key], got)
            ties += problem is None
            if problem is not None:
                failures += 1
                print(f"case {case}: seed {seed} shape {shape} rows {rows} cut {cut} backup {backup} W={W} L={L} "
                      f"lookup {K} {index.__name__} grow {grow} prompt {p_idx}: {problem}")
        if (case + 1) % 50 == 0:
            print(f"fuzz: {case + 1} cases, {failures} divergences, {ties} proven ties, {time.time() - t0:.0f} s",
                  flush=True)
    print(f"fuzz: {n_cases} cases, {failures} divergences, {ties} proven ties, {time.time() - t0:.0f} s")
    assert failures == 0


def test_random_batches_never_diverge(target, model, chat_ids):
    """Random batches: 1-8 rows, more prompts than rows (rows join mid-way), each row with its own random draft
    sources; every row's greedy output equals its prompt decoded alone with AR (or a proven tie).
    FUZZ_BATCHES (default 100) batches."""
    from mlx_redrafter.batch.budget import Budget, CostCurve
    from mlx_redrafter.batch.loop import generate_batch

    n_batches = int(os.environ.get("FUZZ_BATCHES", "100"))
    rng = random.Random(int(os.environ.get("FUZZ_SEED", "0")) + 7919)
    tok = target.tokenizer
    drafters = {s: random_drafter(576, 49152, seed=s, exit_dim=128, draft_vocab_size=4096) for s in range(4)}
    drafters[4] = random_drafter(576, 49152, seed=4, exit_dim=128, draft_vocab_size=4096, feature_layers=list(TAPS))
    flat = CostCurve({b: [1.0 + 0.05 * p for p in range(8)] for b in (1, 2, 4, 8)})
    ar_cache: dict = {}
    ties = failures = rows_checked = 0
    t0 = time.time()

    def allocator():
        slots = []
        if rng.random() < 0.8:
            slots.append(Slot(RnnSource(drafters[rng.randrange(5 if model.feature_layers else 4)], model.embed,
                                        min_confidence=rng.choice([0, 0, 1e-6])), rng.choice([1, 2, 3])))
        if rng.random() < 0.6:
            slots.append(Slot(LookupSource(rng.choice([NgramIndex, SuffixIndex]), max_length=rng.choice([0, 9])),
                              rng.choice([1, 2])))
        return Allocator(slots) if slots else None

    for case in range(n_batches):
        B, n_tok, L = rng.randint(1, 8), rng.choice([8, 16, 24]), rng.randint(2, 6)
        idx = [rng.randrange(len(chat_ids)) for _ in range(rng.randint(1, 10))]
        budget = Budget(L, flat if rng.random() < 0.5 else None)
        model.feature_layers = TAPS if rng.random() < 0.4 else ()
        out: dict[int, list[int]] = {i: [] for i in range(len(idx))}
        for i, r in generate_batch(model, [chat_ids[p] for p in idx], batch_size=B, max_tokens=n_tok,
                                   eos_ids=tok.eos_ids, allocator=allocator, length=L, budget=budget):
            out[i].extend(r.tokens)
        for i, p in enumerate(idx):
            key = (p, n_tok)
            if key not in ar_cache:
                ar_cache[key] = ar_tokens(model, chat_ids[p], n_tok, tok.eos_ids)
            rows_checked += 1
            if out[i] != ar_cache[key]:
                problem = divergence(model, chat_ids[p], ar_cache[key], out[i])
                ties += problem is None
                if problem is not None:
                    failures += 1
                    print(f"batch {case}: B={B} L={L} row {i} prompt {p}: {problem}")
        if (case + 1) % 10 == 0:
            print(f"fuzz batches: {case + 1} batches, {rows_checked} rows, {failures} divergences, {ties} proven "
                  f"ties, {time.time() - t0:.0f} s", flush=True)
    print(f"fuzz batches: {n_batches} batches, {rows_checked} rows, {failures} divergences, {ties} proven ties")
    assert failures == 0
