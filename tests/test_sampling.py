"""Sampling at temperature > 0: the filters, seeded reproducibility, and a statistical test that exact
speculative sampling draws from the target's own distribution (and fails for a deliberately biased rule)."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from mlx_redrafter import api
from mlx_redrafter.accept import Accepted, _child_probs, _walk
from mlx_redrafter.draft.base import Allocator, Slot
from mlx_redrafter.draft.lookup import LookupSource, NgramIndex
from mlx_redrafter.draft.redrafter import RnnSource
from mlx_redrafter.errors import UserError
from mlx_redrafter.generate import collect, generate_speculative
from mlx_redrafter.sampling import Sampling, bias_pairs, probs, sample

ALPHA = 1e-3  # significance of the goodness-of-fit test (seeds are fixed: the outcome is deterministic)
# Draws per test: enough to reject the classic biased rule (`biased_rule`) well below ALPHA (measured on these seeds:
# p = 9.1e-5 after 120 draws, 1.4e-5 after 160; 6.8e-4 after 100), so a rule as wrong as that one cannot pass the
# exactness tests.
DRAWS = 120


def test_filters_keep_the_right_tokens():
    logits = mx.log(mx.array([[0.5, 0.25, 0.15, 0.1]]))
    p = lambda **kw: [round(float(x), 4) for x in np.array(probs(logits, Sampling(temperature=1.0, **kw)))[0]]  # noqa: E731
    assert p() == [0.5, 0.25, 0.15, 0.1]
    assert p(top_k=2) == [0.6667, 0.3333, 0.0, 0.0]
    assert p(top_p=0.7) == [0.6667, 0.3333, 0.0, 0.0]  # 0.5 < 0.7, 0.75 >= 0.7: two tokens
    assert p(top_p=0.5) == [1.0, 0.0, 0.0, 0.0]
    assert p(min_p=0.25) == [0.5556, 0.2778, 0.1667, 0.0]  # drop < 0.125, renormalise
    hot = np.array(probs(logits, Sampling(temperature=2.0)))[0]
    assert hot[0] < 0.5 and abs(hot.sum() - 1) < 1e-6


def test_bad_settings_are_one_line_errors():
    for kw in ({"temperature": -1}, {"top_p": 0}, {"top_k": -2}, {"min_p": 1.0}, {"accept": "fast"}):
        with pytest.raises(UserError):
            Sampling(**kw)


@pytest.fixture(scope="module")
def lm(target):
    from mlx_redrafter.api import LoadedModel, resolve_drafter

    d, name = resolve_drafter("default", target)
    return LoadedModel(target, d, name)


def test_logit_bias_forms_and_one_line_errors():
    assert bias_pairs("5=-100, 2=1.5") == bias_pairs({"2": 1.5, 5: -100}) == ((2, 1.5), (5, -100.0))
    assert Sampling(logit_bias="3=1").logit_bias == ((3, 1.0),) and Sampling().logit_bias == ()
    for bad, needle in (("5", "not ID=BIAS"), ("x=1", "not an integer"), ("5=x", "not a number"),
                        ("5=101", "from -100 to 100"), ("-1=1", "negative"), ("5=1,5=2", "twice"),
                        ({"5": float("nan")}, "from -100 to 100"), ([1, 2], "pair"), (5, "got int")):
        with pytest.raises(UserError, match=needle):
            Sampling(logit_bias=bad)


def test_penalty_settings_are_checked():
    s = Sampling(repetition_penalty=1.2, frequency_penalty=0.5, frequency_context_size=64)
    assert s.penalties == (("repetition", 1.2, 20), ("frequency", 0.5, 64)) and s.recent_size == 64
    assert Sampling(repetition_penalty=1.0).penalties == () == Sampling().penalties  # 0 and 1 are off
    for kw, needle in (({"repetition_penalty": -1}, "--repetition-penalty"), ({"presence_penalty": 2.5}, "-2 to 2"),
                       ({"frequency_penalty": float("nan")}, "--frequency-penalty"),
                       ({"presence_context_size": 0}, "--presence-context-size must be an integer from 1"),
                       ({"repetition_context_size": 1.5}, "--repetition-context-size")):
        with pytest.raises(UserError, match=needle):
            Sampling(**kw)


def test_penalties_and_bias_are_mlx_lms_logits_processors(target, lm):
    """Greedy AR with a logit bias and every penalty decodes what mlx-lm's own logits processors give, applied
    step by step to our target's logits over the prompt and the answer so far."""
    from mlx_lm.sample_utils import make_logits_processors

    from mlx_redrafter.step import ar_logits, prefill_logits

    settings = {"logit_bias": {13: 2.0, 28: -3.0}, "repetition_penalty": 1.4, "repetition_context_size": 12,
                "presence_penalty": 0.6, "presence_context_size": 20, "frequency_penalty": 0.4,
                "frequency_context_size": 30}
    processors = make_logits_processors(**settings)
    model, ids = target.model, target.tokenizer.encode_chat([{"role": "user", "content": "List ten colors."}])
    cache, tokens = model.make_cache(len(ids) + 32), list(ids)
    logits, _ = prefill_logits(model, cache, ids)
    for _ in range(24):
        for process in processors:
            logits = process(mx.array(tokens), logits)
        tokens.append(int(mx.argmax(logits, axis=-1).item()))
        logits = ar_logits(model, cache, mx.array(tokens[-1:]))
    ours = api.generate(lm, ids, max_tokens=24, draft="none", **settings).tokens
    assert ours == tokens[len(ids):][: len(ours)] and len(ours) >= 8


def test_a_banned_token_is_never_sampled(lm):
    ban = api.generate(lm, "Tell me a story.", max_tokens=1, draft="none").tokens[0]
    for draft in ("none", "rnn+lookup"):
        opts = api.decode_options(draft=draft, max_tokens=16,
                                  sampling=Sampling(temperature=1.5, seed=1, logit_bias={ban: -100}))
        assert ban not in api.generate(lm, "Tell me a story.", opts).tokens


def test_seeded_runs_are_reproducible(lm):
    for draft in ("none", "rnn+lookup"):
        opts = api.decode_options(draft=draft, max_tokens=20, sampling=Sampling(temperature=0.9, seed=7))
        a, b = api.generate(lm, "Tell me a story.", opts), api.generate(lm, "Tell me a story.", opts)
        assert a.tokens == b.tokens
        other = api.generate(lm, "Tell me a story.", opts, sampling=Sampling(temperature=0.9, seed=8))
        assert other.tokens != a.tokens


def chi2_sf(x: float, k: int) -> float:
    """P(X >= x) for a chi-square variable with k degrees of freedom (regularised upper incomplete gamma)."""
    a, z = k / 2.0, x / 2.0
    if z < a + 1:  # series for the lower part
        term = total = 1.0 / a
        n = a
        while term > total * 1e-12:
            n += 1
            term *= z / n
            total += term
        return max(0.0, 1.0 - total * math.exp(-z + a * math.log(z) - math.lgamma(a)))
    f, c, d = 1e-300, 1e-300, 0.0  # continued fraction (Lentz) for the upper part
    for i in range(1, 300):
        an = -i * (i - a) if i > 1 else 1.0
        b = z + 2 * i - 1 - a
        d = b + an * d
        d = 1 / (d if abs(d) > 1e-300 else 1e-300)
        c = b + an / c
        f *= c * d
        if abs(c * d - 1) < 1e-12:
            break
    return math.exp(-z + a * math.log(z) - math.lgamma(a)) * f


def exact_distribution(model, cache, prefix_last: int, s: Sampling, depth: int) -> dict[tuple, float]:
    """P(t1..t_depth) of AR sampling with `s`, enumerated over the (top-k restricted) support."""
    out: dict[tuple, float] = {}

    def walk(c, token, seq, prob):
        logits, _ = model(mx.array([[token]]), c)
        c.advance(1)
        p = np.array(probs(logits[0, -1], s))
        for t in np.flatnonzero(p > 0):
            if len(seq) + 1 == depth:
                out[(*seq, int(t))] = prob * float(p[t])
            else:
                walk(c.copy(), int(t), (*seq, int(t)), prob * float(p[t]))

    walk(cache.copy(), prefix_last, (), 1.0)
    return out


def draw(model, cache, prompt_last, history, alloc_fn, s: Sampling, n: int, depth: int) -> Counter:
    counts: Counter = Counter()
    for i in range(n):
        si = replace(s, seed=1000 + i)
        toks, _ = collect(generate_speculative(model, [prompt_last], alloc_fn(), length=3, max_tokens=depth,
                                               sampling=si, cache=cache.copy(), history=history))
        counts[tuple(toks)] += 1
    return counts


def goodness_of_fit(counts: Counter, expected: dict[tuple, float]) -> float:
    """p-value of a chi-square test of counts against the expected distribution (rare cells pooled)."""
    n = sum(counts.values())
    assert set(counts) <= set(expected), "a sequence AR sampling can never produce was drawn"
    cells, pool_obs, pool_exp = [], 0, 0.0
    for key, p in expected.items():
        if p * n >= 5:
            cells.append((counts.get(key, 0), p * n))
        else:
            pool_obs, pool_exp = pool_obs + counts.get(key, 0), pool_exp + p * n
    if pool_exp > 0:
        cells.append((pool_obs, pool_exp))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    return chi2_sf(stat, len(cells) - 1)


def biased_rule(cands, tree, node_p, key):
    """The classic mistake: accept child x iff U < p(x) with no renormalisation over rejected siblings, and
    after a rejection resample from p itself instead of the residual (Apple's residual ignores siblings)."""
    k_u, k_s = mx.random.split(key)
    pc = _child_probs(tree, node_p)
    idx = mx.arange(tree.size)
    sib_before = (tree.parent[:, None] == tree.parent[None, :]) & (idx[None, :] < idx[:, None])
    cond = mx.random.uniform(shape=(tree.size,), key=k_u) < pc
    accepted = cond & ~(sib_before & cond[None, :]).any(axis=1)
    stop, n, path, runs = _walk(tree, cands, accepted)
    return Accepted(n=n, path=path, next_token=sample(node_p[stop], k_s)[None], stop=stop, matched=runs)


@pytest.fixture(scope="module")
def setup(target, lm):
    tok, model = target.tokenizer, target.model
    prompt = tok.encode_chat([{"role": "user", "content": "Write one sentence about the sea."}])
    cache = model.make_cache(len(prompt) + 16)
    model(mx.array([prompt[:-1]]), cache)
    cache.advance(len(prompt) - 1)
    mx.eval(cache.state())

    def alloc():  # sibling candidates at depth 1 and 2 from the trained drafter, plus lookup
        return Allocator([Slot(RnnSource(lm.drafter, model.embed), 3), Slot(LookupSource(NgramIndex), 1)])

    return model, cache, prompt, alloc


def test_exact_speculative_sampling_matches_the_target_distribution(setup):
    model, cache, prompt, alloc = setup
    s = Sampling(temperature=1.0, top_k=3)
    expected = exact_distribution(model, cache, prompt[-1], s, 3)
    counts = draw(model, cache, prompt[-1], prompt[:-1], alloc, s, DRAWS, 3)
    assert goodness_of_fit(counts, expected) > ALPHA


def test_drafts_cut_by_the_drafters_confidence_keep_sampling_exact(setup, lm):
    model, cache, prompt, _ = setup

    def alloc():  # a chain that ends where the drafter doubts, plus lookup
        return Allocator([Slot(RnnSource(lm.drafter, model.embed, min_confidence=0.3), 1),
                          Slot(LookupSource(NgramIndex), 1)])

    s = Sampling(temperature=1.0, top_k=3)
    expected = exact_distribution(model, cache, prompt[-1], s, 3)
    counts = draw(model, cache, prompt[-1], prompt[:-1], alloc, s, DRAWS, 3)
    assert goodness_of_fit(counts, expected) > ALPHA


def test_the_statistical_test_rejects_a_biased_rule(setup):
    model, cache, prompt, alloc = setup
    s = Sampling(temperature=1.0, top_k=3, accept=biased_rule)
    expected = exact_distribution(model, cache, prompt[-1], s, 3)
    counts = draw(model, cache, prompt[-1], prompt[:-1], alloc, s, DRAWS, 3)
    assert goodness_of_fit(counts, expected) < ALPHA


def test_typical_acceptance_runs_and_reports(lm):
    opts = api.decode_options(max_tokens=24, sampling=Sampling(temperature=0.7, seed=0, accept="typical"))
    stats = api.generate(lm, "Name three fruits.", opts).stats
    assert stats.generated_tokens > 0 and stats.steps > 0
    assert api.settings(lm, opts)["accept"] == "typical"
