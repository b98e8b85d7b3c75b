"""The central invariant: greedy ReDrafter output is token-identical to greedy autoregressive decoding (fp32).

Acceptance must not matter for correctness, so a random drafter is used; the shipped drafter is checked in
test_shipped_drafter_exactness (real acceptance, eos inside accepted runs).
"""

import mlx.core as mx
import pytest

from mlx_redrafter.cache import KVCache
from mlx_redrafter.decode import Stats, generate_tokens
from mlx_redrafter.drafter import random_drafter

SHAPES = [(1, 2), (1, 5), (3, 4), (4, 5), (8, 6)]
N_PROMPTS, MAX_TOKENS = 10, 64


@pytest.fixture(scope="module")
def drafter():
    return random_drafter(576, 49152, seed=0, exit_dim=128, draft_vocab_size=4096)


@pytest.fixture(scope="module")
def ar_outputs(target, chat_ids):
    return [
        sum(generate_tokens(target.model, ids, max_tokens=MAX_TOKENS, eos_ids=target.tokenizer.eos_ids), [])
        for ids in chat_ids[:N_PROMPTS]
    ]


def assert_same_or_tie(model, prompt, ar, rd):
    """Equal ids; a difference is only tolerated if the AR path sits on a numerical tie there (DESIGN §4)."""
    if rd == ar:
        return
    i = next((j for j, (a, b) in enumerate(zip(ar, rd)) if a != b), min(len(ar), len(rd)))
    cache = KVCache(30, len(prompt) + len(ar) + 1)
    logits, _ = model(mx.array([prompt + ar[:i]]), cache, last_only=True)
    top2 = mx.sort(logits[0, -1])[-2:]
    gap = (top2[1] - top2[0]).item()
    assert gap < 1e-4, f"ReDrafter diverged from AR at token {i} with top-2 logit gap {gap:.2e} (not a tie)"


@pytest.mark.parametrize("width,length", SHAPES)
def test_redrafter_equals_autoregressive(target, chat_ids, ar_outputs, drafter, width, length):
    for ids, ar in zip(chat_ids[:N_PROMPTS], ar_outputs):
        stats = Stats()
        rd = sum(generate_tokens(target.model, ids, drafter=drafter, beam_width=width, beam_length=length,
                                 max_tokens=MAX_TOKENS, eos_ids=target.tokenizer.eos_ids, stats=stats), [])
        assert_same_or_tie(target.model, ids, ar, rd)
        assert stats.candidate_tokens == stats.steps * width * length
        assert stats.steps <= stats.verified_tokens <= stats.candidate_tokens


SHORT_PROMPTS = [
    "What is the capital of France? Answer in one short sentence.",
    "What is 2 + 2? Reply with just the number.",
    "Say hello.",
    "Name one primary color. One word only.",
]


@pytest.fixture(scope="module")
def shipped():
    from mlx_redrafter.api import shipped_drafter_path
    from mlx_redrafter.drafter import load_drafter

    path = shipped_drafter_path("smollm2-135m")
    assert path is not None, "the trained drafter for the default model is missing from mlx_redrafter/drafters/"
    return load_drafter(path)


@pytest.mark.parametrize("width,length", [(1, 5), (4, 5)])
def test_shipped_drafter_is_exact_and_stops_inside_accepted_runs(target, chat_ids, ar_outputs, shipped,
                                                                width, length):
    tok = target.tokenizer
    short_ids = [tok.encode(tok.chat_prompt([{"role": "user", "content": p}])) for p in SHORT_PROMPTS]
    short_ar = [sum(generate_tokens(target.model, ids, max_tokens=MAX_TOKENS, eos_ids=tok.eos_ids), [])
                for ids in short_ids]
    eos_inside_run, accepted = 0, 0
    for ids, ar in zip(chat_ids[:N_PROMPTS] + short_ids, ar_outputs + short_ar):
        stats = Stats()
        rd = sum(generate_tokens(target.model, ids, drafter=shipped, beam_width=width, beam_length=length,
                                 max_tokens=MAX_TOKENS, eos_ids=tok.eos_ids, stats=stats), [])
        assert_same_or_tie(target.model, ids, ar, rd)
        accepted += sum(n * c for n, c in stats.accepted_hist.items())
        # eos decided inside an accepted run: decided tokens after it were dropped, none emitted
        eos_inside_run += stats.stop_reason == "eos" and stats.discarded_tokens > 0
    assert accepted > 0
    assert eos_inside_run >= 1
