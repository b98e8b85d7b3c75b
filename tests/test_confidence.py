"""Drafts cut where the drafter doubts (`--draft-confidence`): a row's draft ends before the first token at which
the drafter's probability of the whole draft falls below the threshold, its tokens are the full draft's, a row's
cut does not depend on the rows drafted beside it, and decoding stays exact alone and batched."""

import math

import mlx.core as mx
import numpy as np
import pytest
from exactness import ar_tokens, divergence, speculative_tokens

from mlx_redrafter import api
from mlx_redrafter.batch.budget import Budget
from mlx_redrafter.batch.loop import generate_batch
from mlx_redrafter.draft.base import Allocator, Slot
from mlx_redrafter.draft.beam_search import confident_draft, context_of, greedy_draft
from mlx_redrafter.draft.lookup import LookupSource, NgramIndex
from mlx_redrafter.draft.redrafter import FrequentHead, RnnSource
from mlx_redrafter.errors import UserError

LENGTH, MAX_TOKENS = 6, 32


@pytest.fixture(scope="module")
def shipped(target):
    d, _ = api.resolve_drafter("default", target)
    return d


@pytest.fixture(scope="module")
def states(target, chat_ids):
    """The target's features and next tokens at the last 8 positions of a real prompt: 8 rows to draft from."""
    ids = chat_ids[3]
    logits, hidden = target.model(mx.array([ids]), target.model.make_cache(len(ids) + 1))
    return hidden[0, -8:], mx.argmax(logits[0, -8:], axis=-1).astype(mx.int32)


def draft_probabilities(drafter, embed, h, g0, drafts: np.ndarray) -> np.ndarray:
    """(B, L-1): the drafter's probability of each drafted token, computed step by step along the drafts."""
    ctx = context_of(drafter, h)[:, None, :]
    state = mx.zeros((h.shape[0], 1, drafter.drafter.args.hidden_size if isinstance(drafter, FrequentHead)
                      else drafter.args.hidden_size))
    tok, out = g0[:, None], []
    for k in range(drafts.shape[1] - 1):
        state = drafter.next_state(state, embed(tok))
        p = mx.softmax(drafter.logits(ctx, state).astype(mx.float32), axis=-1)[:, 0]  # (B, K)
        out.append(mx.max(p, axis=-1))
        tok = mx.array(drafts[:, k + 1])[:, None]
    return np.array(mx.stack(out, axis=1))


@pytest.mark.parametrize("threshold", [0.05, 0.3, 0.4])  # the first drafts of these rows reach ~0.48
def test_the_cut_follows_the_drafters_probability_of_the_draft(target, shipped, states, threshold):
    h, g0 = states
    head = FrequentHead(shipped, 4096)
    full = np.array(greedy_draft(head, target.model.embed, h, g0, LENGTH))[:, 0]
    cut, lengths = confident_draft(head, target.model.embed, h, g0, LENGTH, threshold)
    probs = np.cumprod(draft_probabilities(head, target.model.embed, h, g0, full), axis=1)
    expected = [1 + int(np.argmin(np.r_[row >= threshold, False])) for row in probs]  # leading drafts above it
    assert lengths == expected
    assert cut.shape[-1] == max(lengths)
    for b, n in enumerate(lengths):
        assert np.array(cut)[b, 0, :n].tolist() == full[b, :n].tolist()
    assert 1 < max(lengths) and (threshold < 0.3 or min(lengths) < LENGTH)  # real drafts, and real cuts


def test_a_rows_cut_does_not_depend_on_the_other_rows(target, shipped, states):
    h, g0 = states
    together, lengths = confident_draft(shipped, target.model.embed, h, g0, LENGTH, 0.2)
    for b in range(h.shape[0]):
        alone, (n,) = confident_draft(shipped, target.model.embed, h[b : b + 1], g0[b : b + 1], LENGTH, 0.2)
        assert n == lengths[b]
        assert np.array(alone)[0, 0, :n].tolist() == np.array(together)[b, 0, :n].tolist()


def test_without_a_threshold_the_drafts_are_the_greedy_drafts(target, shipped, states):
    h, g0 = states
    drafts, lengths = confident_draft(shipped, target.model.embed, h, g0, LENGTH)
    assert lengths is None
    assert mx.array_equal(drafts, greedy_draft(shipped, target.model.embed, h, g0, LENGTH)).item()


def test_decoding_with_cut_drafts_is_exact_alone_and_batched(target, shipped, chat_ids):
    tok, model = target.tokenizer, target.model
    prompts = [chat_ids[i] for i in (0, 17, 33, 61)]
    ar = [ar_tokens(model, p, MAX_TOKENS, tok.eos_ids) for p in prompts]

    def alloc():
        return Allocator([Slot(LookupSource(NgramIndex), 1),
                          Slot(RnnSource(shipped, model.embed, 4096, min_confidence=0.2), 1, backs_up="lookup")])

    shortened = 0
    for p, expected in zip(prompts, ar):
        got, stats = speculative_tokens(model, p, alloc(), LENGTH, MAX_TOKENS, tok.eos_ids)
        assert divergence(model, p, expected, got) is None
        shortened += stats.steps * LENGTH > stats.verified_tokens
    assert shortened  # some drafts were cut
    out = {i: [] for i in range(len(prompts))}
    for i, r in generate_batch(model, prompts, batch_size=3, max_tokens=MAX_TOKENS, eos_ids=tok.eos_ids,
                               allocator=alloc, length=LENGTH, budget=Budget(LENGTH)):
        out[i].extend(r.tokens)
    for i, (p, expected) in enumerate(zip(prompts, ar)):
        assert divergence(model, p, expected, out[i]) is None, f"row {i}"


def test_the_option_is_checked_and_recorded(target, shipped, chat_ids):
    for bad in (1.0, -0.1, math.nan, "0.5", True):
        with pytest.raises(UserError, match="--draft-confidence"):
            api.decode_options(draft_confidence=bad)
    lm = api.LoadedModel(target=target, drafter=shipped, drafter_name="shipped")
    res = api.generate(lm, chat_ids[0], api.decode_options(draft="rnn", draft_confidence=0.25, max_tokens=8))
    assert res.settings["draft_confidence"] == 0.25
    wide = api.generate(lm, chat_ids[0], api.decode_options(draft="rnn", beam_width=2, draft_confidence=0.25,
                                                            max_tokens=8))
    assert wide.settings["draft_confidence"] == 0  # beams are not cut
