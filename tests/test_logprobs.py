"""Log-probabilities of the emitted tokens: the target's own (log-softmax of its raw logits where it decided each
token), the same whether a token came from plain decoding, a draft the verify call accepted, or a batch row."""

import math

import mlx.core as mx
import numpy as np
import pytest

from mlx_redrafter import api
from mlx_redrafter.errors import UserError
from mlx_redrafter.options import decode_options

PROMPTS = ["Copy this exactly: one two three four, one two three four, one two three four.",
           "Name three primary colors.",
           "Write a short poem about the sea."]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def lm(target):
    drafter, name = api.resolve_drafter("default", target)
    return api.LoadedModel(target, drafter, name)


def forward_logprobs(lm, prompt: str, tokens: list[int]) -> np.ndarray:
    """(n, V) log-softmax of the target's logits at the positions that decided `tokens`, from one forward."""
    ids = api.encode_prompt(lm, prompt)
    model = lm.target.model
    logits, _ = model(mx.array([ids + tokens]), model.make_cache(len(ids) + len(tokens) + 1))
    x = logits[0, len(ids) - 1 : len(ids) - 1 + len(tokens)].astype(mx.float32)
    return np.array(x - mx.logsumexp(x, axis=-1, keepdims=True))


@pytest.fixture(scope="module")
def plain(lm):
    return [api.generate(lm, p, max_tokens=MAX_TOKENS, draft="none", logprobs=3) for p in PROMPTS]


def test_plain_decoding_reports_the_targets_own_log_probabilities(lm, plain):
    for p, res in zip(PROMPTS, plain):
        assert [e.token for e in res.logprobs] == res.tokens
        ref = forward_logprobs(lm, p, res.tokens)
        for e, row in zip(res.logprobs, ref):
            assert e.logprob == pytest.approx(row[e.token], abs=1e-4)
            assert [i for i, _ in e.top] == list(np.argsort(-row, kind="stable")[:3])
            assert [v for _, v in e.top] == sorted((v for _, v in e.top), reverse=True)
            assert e.top[0] == (e.token, e.logprob)  # greedy: the chosen token is the most likely one


@pytest.mark.parametrize("draft", ["auto", "rnn", "lookup"])
def test_speculative_decoding_reports_what_plain_decoding_does(lm, plain, draft):
    for p, ref in zip(PROMPTS, plain):
        res = api.generate(lm, p, max_tokens=MAX_TOKENS, draft=draft, logprobs=3)
        assert res.tokens == ref.tokens
        assert len(res.logprobs) == len(res.tokens)
        for a, b in zip(res.logprobs, ref.logprobs):
            assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [i for i, _ in a.top] == [i for i, _ in b.top]
    assert res.stats.tokens_per_step > 1  # drafts were accepted, so some log-probabilities came from a verify call


@pytest.mark.parametrize("draft", ["none", "auto"])
def test_every_batch_row_reports_what_it_reports_alone(lm, plain, draft):
    rows = api.generate_batch(lm, PROMPTS, batch_size=2, max_tokens=MAX_TOKENS, draft=draft, logprobs=3)
    for res, ref in zip(rows, plain):
        assert res.tokens == ref.tokens
        assert [(e.token, [i for i, _ in e.top]) for e in res.logprobs] == \
            [(e.token, [i for i, _ in e.top]) for e in ref.logprobs]
        assert np.allclose([e.logprob for e in res.logprobs], [e.logprob for e in ref.logprobs], atol=1e-4)


def test_sampled_tokens_get_their_raw_log_probabilities_and_a_token_limit_cuts_them(lm):
    p = PROMPTS[2]
    res = api.generate(lm, p, max_tokens=20, temperature=0.9, top_k=20, seed=7, logprobs=0)
    assert len(res.tokens) == len(res.logprobs) and all(e.top == () for e in res.logprobs)
    ref = forward_logprobs(lm, p, res.tokens)
    got = [e.logprob for e in res.logprobs]
    assert np.allclose(got, [row[t] for row, t in zip(ref, res.tokens)], atol=1e-4)  # before temperature, top-k
    assert all(math.isfinite(v) and v <= 0 for v in got)


def test_log_probabilities_are_off_unless_asked_for_and_checked(lm):
    res = api.generate(lm, PROMPTS[1], max_tokens=4)
    assert res.logprobs is None
    for bad in (-1, 21, True, 2.5):
        with pytest.raises(UserError, match="--logprobs must be an integer from 0 to 20"):
            decode_options(logprobs=bad)


def test_a_batch_row_can_score_its_prompt(lm):
    from mlx_redrafter.batch.loop import Batch

    model, tok = lm.target.model, lm.tokenizer
    prompt = tok.encode("The capital of France is Paris. The capital of Germany is")
    batch = Batch(model, tok.eos_ids)
    first = batch.add("a", prompt, max_tokens=4, logprobs=2, score_prompt=True)
    plain = batch.add("b", prompt, max_tokens=4, logprobs=2)
    assert plain.prompt_logprobs is None and first.tokens == plain.tokens
    scored = first.prompt_logprobs
    assert [e.token for e in scored] == prompt[1:]  # every token after the first
    x = model(mx.array([prompt]), model.make_cache(len(prompt) + 1))[0][0].astype(mx.float32)
    ref = np.array(x - mx.logsumexp(x, axis=-1, keepdims=True))
    assert np.allclose([e.logprob for e in scored], [ref[i, t] for i, t in enumerate(prompt[1:])], atol=1e-4)
    assert all(len(e.top) == 2 and e.top[0][1] >= e.logprob for e in scored)
