"""The central invariant: greedy speculative output is token-identical to greedy autoregressive decoding (fp32),
for every draft source and their combination, whatever they propose.

Acceptance must not matter for correctness, so random drafters are used; the shipped drafter is checked too
(real acceptance, eos inside accepted runs). The long randomised sweep is `make fuzz` (test_fuzz.py).
"""

import pytest
from exactness import ar_tokens, divergence, speculative_tokens

from mlx_redrafter import api
from mlx_redrafter.defaults import DEFAULT_LOOKUP_MAX_LENGTH
from mlx_redrafter.draft.base import Allocator, Slot
from mlx_redrafter.draft.lookup import LookupSource, NgramIndex, SuffixIndex
from mlx_redrafter.draft.redrafter import RnnSource, random_drafter

N_PROMPTS, MAX_TOKENS = 3, 24
SHORT_PROMPTS = [
    "What is the capital of France? Answer in one short sentence.",
    "What is 2 + 2? Reply with just the number.",
    "Say hello.",
]
# Text the model will not copy verbatim: lookup proposes long wrong continuations.
COPY_TRAPS = [
    "Here is a list: red green blue red green blue red green blue red green. Now write a different list of "
    "three animals, one per line.",
    "Repeat the word 'cat' ten times, then explain what a cat is: cat cat cat cat cat",
]


# Text the model copies: lookup's copies are accepted whole and grow.
COPY_PROMPT = ("Copy this text exactly, word for word: The old lighthouse keeper climbed the narrow stairs every "
               "evening, lit the great lamp, and watched the ships pass safely through the rocky strait until dawn.")


@pytest.fixture(scope="module")
def drafter():
    return random_drafter(576, 49152, seed=0, exit_dim=128, draft_vocab_size=4096)


@pytest.fixture(scope="module")
def prompts(target, chat_ids):
    tok = target.tokenizer
    mt = [chat_ids[(k * len(chat_ids)) // N_PROMPTS] for k in range(N_PROMPTS)]  # spread over the categories
    return mt + [tok.encode_chat([{"role": "user", "content": p}]) for p in COPY_TRAPS]


@pytest.fixture(scope="module")
def ar_outputs(target, prompts):
    return [ar_tokens(target.model, p, MAX_TOKENS, target.tokenizer.eos_ids) for p in prompts]


def check(target, prompts, ar_outputs, make_allocator, length):
    for p, ar in zip(prompts, ar_outputs):
        got, stats = speculative_tokens(target.model, p, make_allocator(), length, MAX_TOKENS,
                                        target.tokenizer.eos_ids)
        problem = divergence(target.model, p, ar, got)
        assert problem is None, problem
        assert stats.steps <= stats.verified_tokens <= stats.candidate_tokens
    return stats


# The shortest chain, a tree, and a wide deep tree whose beams share many prefixes (the shipped drafter's chain of
# L = 5 is below; `make fuzz` sweeps widths and lengths).
@pytest.mark.parametrize("width,length", [(1, 2), (3, 4), (8, 6)])
def test_rnn_equals_autoregressive(target, prompts, ar_outputs, drafter, width, length):
    stats = check(target, prompts[:N_PROMPTS], ar_outputs[:N_PROMPTS],
                  lambda: Allocator([Slot(RnnSource(drafter, target.model.embed), width)]), length)
    assert stats.candidate_tokens == stats.steps * width * length


# One copy (W = 1) is what the lookup-else-rnn tests below run.
@pytest.mark.parametrize("index,width,length", [(NgramIndex, 3, 4), (SuffixIndex, 2, 6)])
def test_lookup_equals_autoregressive(target, prompts, ar_outputs, index, width, length):
    check(target, prompts, ar_outputs, lambda: Allocator([Slot(LookupSource(index), width)]), length)


def test_rnn_plus_lookup_equals_autoregressive(target, prompts, ar_outputs, drafter):
    stats = check(target, prompts, ar_outputs,
                  lambda: Allocator([Slot(RnnSource(drafter, target.model.embed), 2),
                                     Slot(LookupSource(NgramIndex), 2)], adaptive=True), 4)
    assert set(stats.source_proposed) == {"rnn", "lookup"}


def test_lookup_with_the_answer_table_equals_autoregressive(target, prompts, ar_outputs):
    from mlx_redrafter.api import answer_table
    from mlx_redrafter.draft.lookup import AnswerIndex

    table = answer_table(target)
    assert table is not None, "the answer table of the default model is missing from mlx_redrafter/drafters/"
    stats = check(target, prompts, ar_outputs,
                  lambda: Allocator([Slot(LookupSource(NgramIndex), 1),
                                     Slot(LookupSource(lambda: AnswerIndex(table), "answers"), 2,
                                          backs_up="lookup")]), 5)
    assert stats.source_proposed["answers"] > 0


def test_growing_lookup_copies_equal_autoregressive(target, prompts, ar_outputs, drafter):
    """--lookup-max-length: a copy that was accepted whole is followed by one twice as long (here up to 13 tokens
    at L = 3), with the drafter backing up lookup; the copy prompt makes the copies grow."""
    tok = target.tokenizer
    copy = tok.encode_chat([{"role": "user", "content": COPY_PROMPT}])
    ps, ars = [*prompts, copy], [*ar_outputs, ar_tokens(target.model, copy, MAX_TOKENS, tok.eos_ids)]
    stats = check(target, ps, ars,
                  lambda: Allocator([Slot(LookupSource(NgramIndex, max_length=13), 1),
                                     Slot(RnnSource(drafter, target.model.embed), 2, backs_up="lookup")]), 3)
    assert max(stats.accepted_hist) > 2  # the copy prompt's last run: more drafts accepted in a step than L - 1


def test_drafter_backing_up_lookup_with_a_cut_head_equals_autoregressive(target, prompts, ar_outputs, drafter):
    """lookup-else-rnn with --drafter-vocab: each step either lookup proposes or, where it has nothing to copy, the
    drafter (its head cut to 512 of 4096 rows) proposes its W beams; never both, never neither."""
    stats = check(target, prompts, ar_outputs,
                  lambda: Allocator([Slot(LookupSource(NgramIndex), 1),
                                     Slot(RnnSource(drafter, target.model.embed, vocab_rows=512), 2,
                                          backs_up="lookup")]), 4)
    assert stats.source_proposed["lookup"] > 0 and stats.source_proposed["rnn"] > 0
    assert stats.source_proposed["lookup"] + stats.source_proposed["rnn"] // 2 == stats.steps


@pytest.fixture(scope="module")
def shipped(target):
    from mlx_redrafter.api import resolve_drafter

    d, _ = resolve_drafter("default", target)
    assert d is not None, "the trained drafter for the default model is missing from mlx_redrafter/drafters/"
    return d


@pytest.mark.parametrize("width,length", [(1, 5)])  # trees of the random drafter's beams are above
def test_shipped_drafter_is_exact_and_stops_inside_accepted_runs(target, prompts, ar_outputs, shipped, width,
                                                                length):
    tok = target.tokenizer
    short = [tok.encode_chat([{"role": "user", "content": p}]) for p in SHORT_PROMPTS]
    short_ar = [ar_tokens(target.model, p, MAX_TOKENS, tok.eos_ids) for p in short]
    eos_inside_run, accepted = 0, 0
    for p, ar in zip(prompts[:N_PROMPTS] + short, ar_outputs[:N_PROMPTS] + short_ar):
        alloc = Allocator([Slot(RnnSource(shipped, target.model.embed), width), Slot(LookupSource(NgramIndex), 1)])
        got, stats = speculative_tokens(target.model, p, alloc, length, MAX_TOKENS, tok.eos_ids)
        problem = divergence(target.model, p, ar, got)
        assert problem is None, problem
        accepted += sum(n * c for n, c in stats.accepted_hist.items())
        # eos decided inside an accepted run: decided tokens after it were dropped, none emitted
        eos_inside_run += stats.stop_reason == "eos" and stats.discarded_tokens > 0
    assert accepted > 0
    assert eos_inside_run >= 1


def test_lookup_else_rnn_through_the_api(target, prompts, ar_outputs, shipped):
    """--draft lookup-else-rnn puts the drafter behind lookup; with --drafter-vocab it is exact and recorded."""
    lm = api.LoadedModel(target=target, drafter=shipped, drafter_name="shipped")
    opts = api.decode_options(draft="lookup-else-rnn", beam_length=4, drafter_vocab=4096, max_tokens=MAX_TOKENS)
    slots = api.make_allocator(lm, opts).slots
    assert [(s.source.name, s.backs_up) for s in slots] == [("lookup", None), ("rnn", "lookup")]
    res = api.generate(lm, prompts[0], opts)
    assert res.tokens == ar_outputs[0]
    assert res.settings["draft"] == "lookup-else-rnn" and res.settings["drafter_vocab"] == 4096
    assert slots[0].source.max_length == res.settings["lookup_max_length"] == DEFAULT_LOOKUP_MAX_LENGTH


# Strong enough that each tree node's own path changes the argmax: a version that penalized every node by the
# sequence before the tree alone diverged from AR on prompts[2] in every draft mode (measured).
PENALTIES = {"repetition_penalty": 3.0, "repetition_context_size": 4, "presence_penalty": 0.5,
             "frequency_penalty": 2.0, "frequency_context_size": 8}


SCHEMA = {"type": "object", "properties": {"title": {"type": "string"}, "steps": {"type": "array",
          "items": {"type": "string"}}}, "required": ["title", "steps"], "additionalProperties": False}


@pytest.mark.parametrize("adjust", ["logit_bias", "penalties", "json_schema"])
def test_adjusted_logits_are_exact_in_every_draft_mode_alone_and_batched(target, prompts, shipped, adjust):
    """A logit bias, penalties on recent tokens or a grammar change what every choice reads, greedy included
    (penalties and the grammar: each tree node by its own path): each draft mode decodes what AR decodes with the
    same settings, alone and batched."""
    lm = api.LoadedModel(target, shipped, "shipped")
    prompt = prompts[0] if adjust != "penalties" else prompts[2]
    plain = api.generate(lm, prompt, max_tokens=MAX_TOKENS, draft="none").tokens
    settings = {"logit_bias": {"logit_bias": {plain[1]: -100.0, plain[5]: 4.0}}, "penalties": PENALTIES,
                "json_schema": {"json_schema": SCHEMA}}[adjust]
    ar = api.generate(lm, prompt, max_tokens=MAX_TOKENS, draft="none", **settings).tokens
    assert ar != plain
    if adjust == "logit_bias":
        assert plain[1] not in ar
    for draft in ("rnn", "lookup", "rnn+lookup", "lookup-else-rnn"):
        assert api.generate(lm, prompt, max_tokens=MAX_TOKENS, draft=draft, **settings).tokens == ar, draft
    for draft in ("none", "lookup-else-rnn"):  # batched plain steps take one argmax only for rows without either
        batch = api.generate_batch(lm, [prompt, prompts[1]], batch_size=2, max_tokens=MAX_TOKENS, draft=draft,
                                   **settings)
        assert batch[0].tokens == ar, draft


def test_a_predicted_output_is_copied_where_the_answer_follows_it_and_changes_nothing(target, prompts, shipped):
    """A prediction (OpenAI's predicted outputs) is drafted from in every mode, alone and batched: the answer is
    AR's whether the prediction is the answer itself, the answer with a changed middle, or unrelated text."""
    lm = api.LoadedModel(target, shipped, "shipped")
    tok = target.tokenizer
    ar = api.generate(lm, prompts[0], max_tokens=MAX_TOKENS, draft="none")
    changed = tok.decode(ar.tokens[:8] + tok.encode(" something else entirely,") + ar.tokens[12:])
    for prediction in (ar.text, changed, "Unrelated words about a cat."):
        for draft in ("rnn", "lookup-else-rnn"):
            got = api.generate(lm, prompts[0], max_tokens=MAX_TOKENS, draft=draft, prediction=prediction)
            assert got.tokens == ar.tokens, (draft, prediction)
            if prediction == ar.text:
                assert got.stats.source_runs["prediction"] >= MAX_TOKENS // 2 and got.stats.steps <= MAX_TOKENS // 3
    batch = api.generate_batch(lm, [prompts[0], prompts[1]], batch_size=2, max_tokens=MAX_TOKENS,
                               prediction=changed)
    assert batch[0].tokens == ar.tokens and batch[0].stats.source_runs["prediction"] > 0

def test_continuing_a_conversation_reuses_the_cache(target, chat_ids, drafter):
    """Turn 2 decoded on top of turn 1's KV cache (only the new tokens prefilled) equals AR over everything."""
    from mlx_redrafter.generate import collect, generate_speculative

    tok, model = target.tokenizer, target.model
    first = chat_ids[5]
    cache = model.make_cache(512)
    alloc = Allocator([Slot(RnnSource(drafter, model.embed), 2), Slot(LookupSource(NgramIndex), 1)])
    answer, _ = collect(generate_speculative(model, first, alloc, length=4, max_tokens=12, eos_ids=tok.eos_ids,
                                             cache=cache))
    assert cache.offset == len(first) + len(answer)  # the cache holds everything emitted
    follow = tok.encode("\n<|im_start|>user\nShorter, please.<|im_end|>\n<|im_start|>assistant\n")
    got, stats = collect(generate_speculative(model, follow, alloc, length=4, max_tokens=16, eos_ids=tok.eos_ids,
                                              cache=cache, history=first + answer))
    assert stats.prompt_tokens == len(follow)
    full = first + answer + follow
    assert divergence(model, full, ar_tokens(model, full, 16, tok.eos_ids), got) is None
