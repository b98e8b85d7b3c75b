"""Batched decoding: every row of a batch decodes exactly what its prompt decodes alone (greedy fp32: the same
ids; sampling: the same distribution), whatever the batch size, the draft sources, the rows' lengths and when
they join or leave; and the batch's cache keeps each row's context apart."""

from collections import Counter

import mlx.core as mx
import pytest
from exactness import ar_tokens, divergence
from test_sampling import ALPHA, DRAWS, exact_distribution, goodness_of_fit

from mlx_redrafter import api
from mlx_redrafter.batch.budget import Budget, CostCurve
from mlx_redrafter.batch.cache import WINDOW_ALIGN, RowsCache, plan_windows
from mlx_redrafter.batch.loop import Batch, generate_batch
from mlx_redrafter.draft.base import Allocator, DecodeState, Slot, propose, propose_rows
from mlx_redrafter.draft.lookup import LookupSource, NgramIndex
from mlx_redrafter.draft.redrafter import RnnSource, random_drafter
from mlx_redrafter.errors import UserError
from mlx_redrafter.sampling import Rng, Sampling

MAX_TOKENS = 24
ROWS = 6  # rows of the seeded sampling test decoding at once
TEXTS = [
    "Say hello.",
    "Copy this text exactly: the quick brown fox jumps over the lazy dog, the quick brown fox jumps again.",
    "What is 2 + 2? Reply with just the number.",
    "Write a short poem about the sea, in four lines, with a rhyme in every second line.",
    "Here is a list: red green blue red green blue red green. Now list three animals.",
]


@pytest.fixture(scope="module")
def prompts(target, chat_ids):
    tok = target.tokenizer
    return [tok.encode_chat([{"role": "user", "content": t}]) for t in TEXTS] + [chat_ids[5], chat_ids[40]]


@pytest.fixture(scope="module")
def ar_outputs(target, prompts):
    return [ar_tokens(target.model, p, MAX_TOKENS, target.tokenizer.eos_ids) for p in prompts]


def batch_tokens(target, prompts, batch_size, allocator=lambda: None, length=4, curve=None,
                 sampling=Sampling()) -> tuple[dict[int, list[int]], list]:
    out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    records = []
    for i, r in generate_batch(target.model, prompts, batch_size=batch_size, max_tokens=MAX_TOKENS,
                               eos_ids=target.tokenizer.eos_ids, sampling=sampling, allocator=allocator,
                               length=length, budget=Budget(length, curve)):
        out[i].extend(r.tokens)
        records.append((i, r))
    return out, records


def assert_exact(target, prompts, ar_outputs, out):
    for i, (p, ar) in enumerate(zip(prompts, ar_outputs)):
        problem = divergence(target.model, p, ar, out[i])
        assert problem is None, f"row {i}: {problem}"


@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_batched_plain_decoding_equals_each_prompt_alone(target, prompts, ar_outputs, batch_size):
    out, records = batch_tokens(target, prompts, batch_size)
    assert_exact(target, prompts, ar_outputs, out)
    assert all(r.verified <= 1 for _, r in records)


@pytest.mark.parametrize("batch_size", [2, 8])  # rows refilled as others finish; every prompt at once
def test_batched_speculative_decoding_equals_each_prompt_alone(target, prompts, ar_outputs, batch_size):
    """Trees of different sizes per row (a random drafter's 2 beams plus growing lookup copies), rows joining
    mid-way (more prompts than rows) and finishing at different steps."""
    drafter = random_drafter(576, 49152, seed=0, exit_dim=128, draft_vocab_size=4096)
    alloc = lambda: Allocator([Slot(RnnSource(drafter, target.model.embed), 2),  # noqa: E731
                               Slot(LookupSource(NgramIndex, max_length=9), 1)])
    out, records = batch_tokens(target, prompts, batch_size, alloc)
    assert_exact(target, prompts, ar_outputs, out)
    assert any(r.accepted > 0 for _, r in records)  # copies were accepted: the commit moved real paths
    steps_per_row = {i: sum(1 for j, r in records if j == i and not r.prefill) for i in range(len(prompts))}
    assert len(set(steps_per_row.values())) > 1  # rows finished at different steps


def test_key_windows_group_rows_by_where_their_entries_start():
    """Consecutive rows whose entries start late form a block attended from there (at an aligned slot); a batch
    whose rows all start at slot 0 keeps one window, as does one where splitting would save too little."""
    assert plan_windows([0, 0, 0], 400) is None and plan_windows([], 0) is None
    assert plan_windows([0, 3, 9], 400) is None  # 9 rounds down to 0
    assert plan_windows([0, 390], 400) is None  # one row, 10 keys: not worth a block
    firsts = [0, 5, 300, 301, 330, 300, 300, 298]
    windows = plan_windows(firsts, 400)
    assert windows is not None
    assert windows[0][0] == 0 and windows[-1][1] == len(firsts)
    assert all(a[1] == b[0] for a, b in zip(windows, windows[1:]))  # contiguous blocks of rows
    for a, b, lo in windows:
        assert lo % WINDOW_ALIGN == 0 and all(lo <= f for f in firsts[a:b])
    assert windows[0] == (0, 2, 0) and windows[1][2] == 288


@pytest.mark.parametrize("tokens", [1, 3])
def test_rows_that_start_late_attend_from_their_first_slot_with_the_same_bits(target, prompts, monkeypatch, tokens):
    """Rows that joined a cache after a long row sit at the end of its committed region: a forward attends them
    from their first slot (`key_windows`), not from slot 0, and its logits and states are bit for bit those of
    attending the whole cache (decode steps and verifications of several tokens alike)."""
    model = target.model
    long = [t for p in prompts for t in p][:400]
    cache = RowsCache(model.args.num_hidden_layers, 64)
    for row in [long] + prompts[:5]:
        one = model.make_cache(len(row))
        model(mx.array([row]), one)
        one.advance(len(row))
        cache.join(one)
    windows = cache.key_windows()
    assert windows is not None and len(windows) == 2 and windows[1][2] > 0
    B = cache.rows
    feed = mx.array([[p[-1]] * tokens for p in [long] + prompts[:5]])
    positions = mx.array(cache.lengths)[:, None] + mx.arange(tokens)[None, :]
    causal = mx.tril(mx.ones((tokens, tokens), dtype=mx.bool_))
    mask = mx.concatenate([mx.broadcast_to(cache.context_mask()[:, None, :], (B, tokens, cache.offset)),
                           mx.broadcast_to(causal, (B, tokens, tokens))], axis=2)[:, None]
    windowed = model(feed, cache, positions, mask)
    mx.eval(windowed)
    monkeypatch.setattr(RowsCache, "key_windows", lambda self: None)
    whole = model(feed, cache, positions, mask)
    for a, b in zip(windowed, whole):
        assert mx.array_equal(a, b).item()


@pytest.mark.parametrize("width", [1, 3])
def test_rows_sharing_a_drafter_draft_together_what_each_drafts_alone(target, prompts, width):
    """A batch's rows that use one drafter are drafted in one call (the weights are read once per drafted token,
    not once per row), and each row gets the candidates it would get alone; a row whose lookup found a copy does
    not ask its backup drafter."""
    model = target.model
    drafter, _ = api.resolve_drafter("default", target)
    states = []
    for p in prompts[:4]:
        cache = model.make_cache(len(p))
        _, hidden = model(mx.array([p[:-1]]), cache)
        states.append(DecodeState(tokens=list(p), g0=mx.array(p[-1:], dtype=mx.int32), h=hidden[:, -1]))
    calls = []

    class Counted(RnnSource):
        def propose_many(self, states, length, width):
            calls.append(len(states))
            return super().propose_many(states, length, width)

    def plan():
        lookup = LookupSource(NgramIndex)
        return [Slot(lookup, 1), Slot(Counted(drafter, model.embed), width, backs_up="lookup")]

    plans = [plan() for _ in states]
    for r, (pl, st) in enumerate(zip(plans, states)):
        pl[0].source.start(st.tokens if r == 1 else st.tokens[-1:])  # only row 1's lookup has text to copy from
    together = propose_rows(plans, states, [4] * len(states))
    assert len(calls) == 1
    asked = calls[0]
    calls.clear()
    alone = [propose(pl, st, 4) for pl, st in zip(plans, states)]
    assert calls == [1] * asked == [1] * (len(states) - 1)
    for t, a in zip(together, alone):
        assert t.rows == a.rows and t.candidates.tolist() == a.candidates.tolist()


def test_every_draft_mode_of_the_shipped_drafter_batches_exactly(target, prompts, ar_outputs):
    lm = api.LoadedModel(target, *api.resolve_drafter("default", target))
    for mode in ("auto", "rnn", "lookup", "rnn+lookup"):
        options = api.decode_options(draft=mode, max_tokens=MAX_TOKENS)
        out, _ = batch_tokens(target, prompts, 4, lambda o=options: api.make_allocator(lm, o))
        assert_exact(target, prompts, ar_outputs, out)


def test_the_budget_backs_off_to_plain_steps_when_drafts_do_not_pay(target, prompts, ar_outputs):
    """A curve where every extra token costs as much as a whole call: speculation cannot pay, the budget picks
    length 1 except on its probe steps, and the output is still exact."""
    steep = CostCurve({b: [float(p) for p in range(1, 9)] for b in (1, 2, 4, 8)})
    drafter = random_drafter(576, 49152, seed=0, exit_dim=128, draft_vocab_size=4096)
    alloc = lambda: Allocator([Slot(RnnSource(drafter, target.model.embed), 1)])  # noqa: E731
    out, records = batch_tokens(target, prompts, 4, alloc, curve=steep)
    assert_exact(target, prompts, ar_outputs, out)
    decode = [r for _, r in records if not r.prefill]
    assert sum(r.verified == 1 for r in decode) > len(decode) // 2


def test_api_batch_matches_generate(target):
    lm = api.LoadedModel(target, *api.resolve_drafter("default", target))
    texts = TEXTS[:3]
    batch = api.generate_batch(lm, texts, batch_size=2, max_tokens=16)
    for t, res in zip(texts, batch):
        alone = api.generate(lm, t, max_tokens=16)
        assert res.tokens == alone.tokens and res.text == alone.text
        assert res.stats.generated_tokens == len(res.tokens)
    with pytest.raises(UserError):
        api.generate_batch(lm, texts, batch_size=0)


def test_rows_keep_their_own_context(target):
    """Rows of different lengths in one cache: a row joined later sits at the end of the committed region and
    its holes are masked; dropping a row keeps the others' entries and lengths."""
    model = target.model
    cache = RowsCache(model.args.num_hidden_layers, 64)
    for n in (5, 9, 3):
        one = model.make_cache(n)
        model(mx.array([list(range(100, 100 + n))]), one)
        one.advance(n)
        cache.join(one)
    assert cache.offset == 9 and cache.lengths == [5, 9, 3]
    assert cache.valid[:, :9].sum(axis=1).tolist() == [5, 9, 3]
    assert cache.valid[2, 6:9].all() and not cache.valid[2, :6].any()
    cache.select([2, 0])
    assert cache.lengths == [3, 5] and cache.keys[0].shape[0] == 2


def test_seeded_batched_sampling_matches_the_target_distribution(target, lm_for_sampling):
    """Each row samples from the target's own distribution (rows of one prompt, each with its own seed). The rows
    continue one prefilled cache of the prompt's history (as a server's cached conversation does), so the test
    spends its time on the batched steps rather than on a prefill per row."""
    model, prompt, alloc = lm_for_sampling
    s = Sampling(temperature=1.0, top_k=3, seed=1000)
    cache = model.make_cache(len(prompt) + 8)
    model(mx.array([prompt[:-1]]), cache)
    cache.advance(len(prompt) - 1)
    mx.eval(cache.state())
    expected = exact_distribution(model, cache, prompt[-1], s, 3)
    rows: dict[int, list[int]] = {}
    batch, waiting = Batch(model, target.tokenizer.eos_ids, 3), list(range(DRAWS))
    while waiting or len(batch):
        while waiting and len(batch) < ROWS:
            i = waiting.pop(0)
            rows[i] = batch.add(i, prompt[-1:], max_tokens=3, sampling=s, allocator=alloc(), cache=cache.copy(),
                                history=prompt[:-1], rng=Rng(1000 + i)).tokens
            if batch.done():
                batch.remove(i)
        for i, r in batch.step():
            rows[i] = rows[i] + r.tokens
        for i in batch.done():
            batch.remove(i)
    counts = Counter(tuple(toks) for toks in rows.values())
    assert len(counts) > 3 and goodness_of_fit(counts, expected) > ALPHA


@pytest.fixture(scope="module")
def lm_for_sampling(target):
    tok, model = target.tokenizer, target.model
    prompt = tok.encode_chat([{"role": "user", "content": "Write one sentence about the sea."}])
    drafter, _ = api.resolve_drafter("default", target)

    def alloc():
        return Allocator([Slot(RnnSource(drafter, model.embed), 3), Slot(LookupSource(NgramIndex), 1)])

    return model, prompt, alloc


def test_a_removed_row_takes_a_cache_that_continues_exactly(target, prompts):
    """A row taken out mid-way (e.g. a server request that finished or was cancelled) carries a compact cache of
    exactly the tokens it reports; continuing from it equals decoding those tokens from scratch; a row added with
    a cache that holds its history prefills only the new tokens and decodes exactly."""
    from mlx_redrafter.batch.loop import Batch

    model, eos = target.model, target.tokenizer.eos_ids
    batch = Batch(model, eos, length=4)
    for k in range(3):
        batch.add(k, prompts[k], max_tokens=200, allocator=Allocator([Slot(LookupSource(NgramIndex), 1)]))
    for _ in range(4):
        batch.step()
    cache, held = batch.remove(1, with_cache=True)
    assert batch.keys == [0, 2] and cache.offset == len(held) and held[: len(prompts[1])] == prompts[1]
    more = ar_tokens(model, held, 8, eos)
    resumed = Batch(model, eos, length=4)
    got = resumed.add("again", [more[0]], max_tokens=7, cache=cache, history=held).tokens
    while not resumed.done():
        got += [t for _, r in resumed.step() for t in r.tokens]
    assert got == ar_tokens(model, held + [more[0]], 7, eos)


def budget_choices(curve, accepted, seconds, rows=4, steps=200, kind=lambda step: "rnn"):
    """The longest length a budget (length 4, probes after 4 steps, at most 32 apart) picks at each of `steps`
    steps of `rows` drafting rows, when every row drafts from `kind(step)`, accepts `accepted(n, kind)` drafts at
    length n and the step takes `seconds(n, step)`."""
    budget = Budget(4, curve, probe=4, max_probe=32)
    for _ in range(rows):
        budget.join()
    chosen = []
    for step in range(steps):
        k = kind(step)
        lengths = budget.lengths([k] * rows)
        n = max(lengths)
        chosen.append(n)
        budget.observe(lengths, [accepted(n, k)] * rows, seconds=seconds(n, step))
    return chosen


def test_the_budget_measures_plain_steps_first_and_probes_less_often_while_one_kind_keeps_winning():
    """No model needed: the budget's choices alone. The first step at a batch size is plain (the reference); while
    speculation keeps losing, the probes that try it come further and further apart (at most `max_probe`)."""
    steep = CostCurve({b: [float(p) for p in range(1, 9)] for b in (1, 2, 4, 8)})
    chosen = budget_choices(steep, accepted=lambda n, k: 0, seconds=lambda n, step: float(n))
    assert chosen[0] == 1
    probes = [i for i, n in enumerate(chosen) if n > 1]
    assert probes and all(chosen[i] == 2 for i in probes)
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == sorted(gaps) and gaps[-1] == 32
    assert len(probes) <= 10


def test_one_slow_step_does_not_keep_the_batch_from_speculating():
    """No model needed. Speculation pays (every draft accepted, a step of 4 tokens costs 1.2 plain ones); one
    speculative step beside a plain probe takes 40x as long (the cache grew, another process ran): the budget
    goes on drafting the full length instead of backing off until many probes wash the outlier out."""
    flat = CostCurve({b: [1.0 + 0.01 * p for p in range(8)] for b in (1, 2, 4, 8)})
    budget = Budget(4, flat, probe=4, max_probe=32)
    for _ in range(4):
        budget.join()
    chosen, previous, slowed = [], 1, False
    for step in range(160):
        lengths = budget.lengths(["rnn"] * 4)
        n = max(lengths)
        seconds = 1.0 if n == 1 else 1.2
        if step > 60 and n > 1 and previous == 1 and not slowed:
            seconds, slowed = 40.0, True
        chosen.append(n)
        budget.observe(lengths, [n - 1] * 4, seconds=seconds)
        previous = n
    assert slowed
    late = chosen[70:]
    assert sum(n == 4 for n in late) >= 0.85 * len(late)


@pytest.mark.parametrize("accepting", [False, True])
def test_the_budget_prices_speculative_steps_by_what_they_cost_beside_plain_ones(accepting):
    """No model needed. The curve says drafting is free; the steps really cost half a plain step more per extra
    token, and every step costs more as the contexts grow (a cost measured long ago is stale). Rows whose drafts
    are rejected end up on plain steps (but for rare probes); rows whose drafts are all accepted (n tokens for
    1 + (n - 1) / 2 the cost) draft the full length."""
    flat = CostCurve({b: [1.0 + 0.01 * p for p in range(8)] for b in (1, 2, 4, 8)})
    chosen = budget_choices(flat, accepted=lambda n, k: n - 1 if accepting else 0,
                            seconds=lambda n, step: (1.0 + 0.5 * (n - 1)) * (1 + step / 25))
    late = chosen[50:]
    if accepting:
        assert sum(n == 4 for n in late) >= 0.9 * len(late)
    else:
        assert sum(n > 1 for n in late) <= 8


def test_a_budget_priced_by_the_curve_alone_chooses_the_same_steps_whatever_they_took(monkeypatch):
    """No model needed. REDRAFTER_STEP_COSTS=curve: the choices depend on what the rows accepted, not on the steps'
    times (two runs, one with every step timed alike and one with wild times, choose alike); rows whose drafts are
    accepted draft from the first step (no plain reference step) and the full length from the next, rows whose
    drafts are rejected     back off to plain steps but for probes that try drafting again. Another value is a one-
    line UserError."""
    from mlx_redrafter.errors import UserError

    monkeypatch.setenv("REDRAFTER_STEP_COSTS", "curve")
    curve = CostCurve({b: [1.0 + 0.1 * p for p in range(8)] for b in (1, 2, 4, 8)})
    for accepting in (True, False):
        runs = [budget_choices(curve, accepted=lambda n, k, a=accepting: n - 1 if a else 0, seconds=seconds,
                               steps=120)
                for seconds in (lambda n, step: 1.0, lambda n, step: 40.0 * n if step % 7 else 0.01)]
        assert runs[0] == runs[1]
        if accepting:
            assert runs[0][0] > 1 and all(n == 4 for n in runs[0][1:])
        else:
            assert runs[0][0] > 1 and sum(n > 1 for n in runs[0][20:]) <= 6
    monkeypatch.setenv("REDRAFTER_STEP_COSTS", "timed")
    with pytest.raises(UserError, match="REDRAFTER_STEP_COSTS='timed' is not a known value; use one of: auto, "):
        Budget(4, curve)


def test_a_copy_of_the_predicted_output_drafts_long_from_its_first_step():
    """No model needed. Before any row has drafted so, a copy of the request's predicted output while the answer
    follows it (the kind the prediction source names then) is priced at its prior, `PRIORS`: a fresh budget gives it
    the whole copy where a copy from the context after a 2-token match (no prior of its own) gets less."""
    from functools import partial

    from mlx_redrafter.batch.budget import PRIORS
    from mlx_redrafter.draft.base import DecodeState
    from mlx_redrafter.draft.lookup import LookupSource, PredictionIndex

    source = LookupSource(partial(PredictionIndex, [5, 6, 7, 8, 9, 10, 11, 12]), "prediction", 9, 4)
    source.start([1, 2, 5])  # the answer's first token is the prediction's: the answer follows it
    state = DecodeState(tokens=[1, 2, 5], g0=mx.array([5]), h=mx.zeros((1, 4)))
    assert source.propose(state, 4, 1) is not None
    assert source.kind in PRIORS
    curve = CostCurve({b: [1.0 + 0.1 * p for p in range(9)] for b in (1, 2, 4, 8)})
    for kind, want in ((source.kind, 8), ("lookup2", 3)):
        budget = Budget(9, curve, measured=False)
        budget.join(copy_cap=8)
        assert budget.lengths([kind], offered=[8]) == [want]


def test_the_budget_prices_each_step_by_what_the_rows_draft_from():
    """No model needed. Rows alternate between stretches where they copy from their context (every draft
    accepted) and stretches where only the drafter drafts (every draft rejected); a drafted token costs a fifth of
    a plain step. One acceptance per row would average the two and pick the same length for both; kept per kind of
    draft, copies get the full length and the drafter's steps back off to plain ones."""
    curve = CostCurve({b: [1.0 + 0.2 * p for p in range(8)] for b in (1, 2, 4, 8)})
    kind = lambda step: "lookup" if (step // 10) % 2 else "rnn"  # noqa: E731
    chosen = budget_choices(curve, accepted=lambda n, k: n - 1 if k == "lookup" else 0,
                            seconds=lambda n, step: 1.0 + 0.2 * (n - 1), kind=kind)
    copies = [n for i, n in enumerate(chosen) if i >= 40 and kind(i) == "lookup"]
    drafts = [n for i, n in enumerate(chosen) if i >= 40 and kind(i) == "rnn"]
    assert sum(n == 4 for n in copies) >= 0.9 * len(copies)
    assert sum(n == 1 for n in drafts) >= 0.9 * len(drafts)



def test_rows_of_different_lengths_verify_ragged_and_exactly(target, prompts, ar_outputs):
    """Rows capped at different candidate lengths (2 to 5) verify trees of different sizes in one step: the
    forward runs them ragged (the products over the real tokens only) and every row still decodes what its
    prompt decodes alone."""
    from mlx_redrafter.batch.loop import Batch

    model, eos = target.model, target.tokenizer.eos_ids
    drafter = random_drafter(576, 49152, seed=1, exit_dim=128, draft_vocab_size=4096)
    batch = Batch(model, eos, length=5)
    rows = range(4)
    out = {i: batch.add(i, prompts[i], max_tokens=MAX_TOKENS, length=2 + i,
                        allocator=Allocator([Slot(LookupSource(NgramIndex), 1),
                                             Slot(RnnSource(drafter, model.embed), 1, backs_up="lookup")])).tokens
           for i in rows}
    mixed = 0
    while len(batch):
        step = batch.step()
        mixed += len({r.verified for _, r in step}) > 1
        for i, r in step:
            out[i] += r.tokens
        for key in batch.done():
            batch.remove(key)
    assert mixed > 0
    assert_exact(target, [prompts[i] for i in rows], [ar_outputs[i] for i in rows], out)


def test_the_budget_gives_each_row_the_length_its_kind_of_draft_pays_for():
    """No model needed. Two rows copy after a long match (every draft accepted), two draft from the drafter (every
    draft rejected); a drafted token costs a tenth of a plain step's tokens. Priced by the tokens the step verifies
    in all, the copying rows take their whole copies and the drafter's rows verify their own token alone, where
    one common length would have to give every row the same."""
    curve = CostCurve({b: [1.0 + 0.1 * b * (p - 1) for p in range(1, 10)] for b in (1, 2, 4, 8)})
    budget = Budget(4, curve, probe=1000, max_probe=1000)
    for _ in range(4):
        budget.join(copy_cap=8)
    kinds, offered = ["lookup4", "rnn", "lookup4", "rnn"], [8, None, 8, None]
    for _ in range(60):
        lengths = budget.lengths(kinds, offered=offered)
        tokens = sum(lengths)
        budget.observe(lengths, [n - 1 if k == "lookup4" else 0 for n, k in zip(lengths, kinds)],
                       seconds=1.0 + 0.1 * (tokens - 4))
    assert lengths == [8, 1, 8, 1]
    assert budget.acceptance("lookup4") > 0.9 and budget.acceptance("rnn") < budget.prior


def test_a_cost_curve_that_other_work_shaped_is_not_taken_for_the_machines():
    """No model needed. A quiet curve rises with the tokens per row; one where a longer candidate cost less than a
    shorter one, whose repeats were far apart, or measured with most cores busy, priced the other work."""
    rising = {b: [0.03 * b * (1 + 0.1 * p) for p in range(8)] for b in (1, 2)}
    assert CostCurve(rising).unsteady() is None
    assert CostCurve(rising, meta={"spread": 0.05, "load": 0.4, "cores": 2}).unsteady() is None
    dip = {1: rising[1], 2: rising[2][:3] + [0.5 * rising[2][3]] + rising[2][4:]}
    assert "4 tokens per row cost less than 3 at batch 2" in CostCurve(dip).unsteady()
    assert "apart" in CostCurve(rising, meta={"spread": 0.6}).unsteady()
    assert "load 3.0 on 2 cores" in CostCurve(rising, meta={"load": 3.0, "cores": 2}).unsteady()


def test_a_measured_cost_curve_is_kept_only_when_measured_quiet(target, tmp_path, monkeypatch):
    """The real model, measured for batches 1-2 and 1-2 tokens per row: kept beside the tuned settings exactly
    when it looks quiet (this test may run beside other work); a kept curve that does not look quiet (kept before
    this check existed) is measured again rather than trusted."""
    from mlx_redrafter.batch.budget import curve_file, measured_curve, stored_curve

    monkeypatch.setenv("REDRAFTER_TUNED_FILE", str(tmp_path / "tuned.json"))
    said: list[str] = []
    curve = measured_curve(target.model, "smollm2-135m", "here", 2, 2, log=said.append)
    assert sorted(curve.seconds) == [1, 2] and all(len(v) == 2 for v in curve.seconds.values())
    assert {"spread", "load", "cores"} <= set(curve.meta)
    kept = curve_file("smollm2-135m", "here").exists()
    assert kept == (curve.unsteady() is None)
    assert kept or any("busy" in m and "next run measures again" in m for m in said)
    CostCurve({1: [0.02, 0.01], 2: [0.04, 0.05]}).save(curve_file("smollm2-135m", "here"))
    assert stored_curve("smollm2-135m", "here", 2, 2) is None
