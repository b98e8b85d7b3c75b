"""After ReDrafter steps the committed KV cache is the one autoregressive decoding builds; after any generation a
cache passed in holds exactly history + prompt + every emitted token."""

import mlx.core as mx
import pytest

from mlx_redrafter.cache import KVCache
from mlx_redrafter.draft.base import Allocator, Slot
from mlx_redrafter.draft.redrafter import RnnSource, random_drafter
from mlx_redrafter.generate import collect, generate_ar, generate_speculative


def test_committed_cache_equals_ar_cache(target, chat_ids):
    model, prompt = target.model, chat_ids[2]
    drafter = random_drafter(576, 49152, seed=1)
    rd_cache = model.make_cache(512)
    alloc = Allocator([Slot(RnnSource(drafter, model.embed), 3)])
    rd, rd_stats = collect(generate_speculative(model, prompt, alloc, length=4, max_tokens=20, cache=rd_cache))
    ar_cache = model.make_cache(512)
    ar, _ = collect(generate_ar(model, prompt, max_tokens=20, cache=ar_cache))
    assert rd == ar and rd_stats.steps > 0
    # Both caches hold the prompt and every emitted token (the last one fed when the generation ended).
    assert rd_cache.offset == ar_cache.offset == len(prompt) + 20
    # fp32 noise floor: the same cache computed a third correct way (one prefill of prompt + tokens) differs
    # from the AR cache by ~1e-5 (K/V reach |20|; matrix-vector vs matrix-matrix summation order). The
    # ReDrafter cache must be within 1e-5 or within twice that floor; a wrong commit is off by O(1).
    seq = prompt + ar
    prefill_cache = model.make_cache(512)
    model(mx.array([seq]), prefill_cache)
    prefill_cache.advance(len(seq))
    worst = floor = 0.0
    for layer in range(model.args.num_hidden_layers):
        for got, ref, other in zip(rd_cache.committed(layer), ar_cache.committed(layer),
                                   prefill_cache.committed(layer)):
            assert got.dtype == ref.dtype == mx.float32
            worst = max(worst, mx.abs(got - ref).max().item())
            floor = max(floor, mx.abs(other - ref).max().item())
    assert worst <= max(1e-5, 2 * floor), (worst, floor)


def test_cache_commit_moves_the_accepted_path():
    cache = KVCache(1, 16)
    k = mx.arange(6 * 2, dtype=mx.float32).reshape(1, 1, 6, 2)
    cache.write(0, k, k)
    cache.advance(2)
    cache.write(0, k[:, :, :4] + 100, k[:, :, :4] + 100)  # scratch at 2..5
    cache.commit(mx.array([0, 2, 3]), 2)  # path through scratch entries 0, 2, 3; keep 2
    keys, _ = cache.committed(0)
    assert cache.offset == 4
    assert keys[0, 0].tolist() == [[0, 1], [2, 3], [100, 101], [104, 105]]


def test_select_keeps_batch_rows():
    cache = KVCache(1, 8)
    k = mx.arange(3 * 2, dtype=mx.float32).reshape(3, 1, 1, 2)
    cache.write(0, k, k)
    cache.advance(1)
    cache.select(mx.array([2, 0]))
    keys, values = cache.committed(0)
    assert keys[:, 0, 0].tolist() == [[4, 5], [0, 1]] and values.shape == (2, 1, 1, 2)


def test_commit_copies_nothing_when_the_path_is_in_place():
    cache = KVCache(1, 16)
    k = mx.arange(6 * 2, dtype=mx.float32).reshape(1, 1, 6, 2)
    cache.write(0, k, k)
    cache.advance(2)
    cache.write(0, k[:, :, :4] + 100, k[:, :, :4] + 100)
    before = cache.keys[0]
    cache.commit(mx.array([0, 1, 3]), 2)  # the kept entries 0, 1 are where they belong
    assert cache.keys[0] is before and cache.offset == 4
    assert cache.committed(0)[0][0, 0].tolist() == [[0, 1], [2, 3], [100, 101], [102, 103]]


# --- the cache after a generation, through the API ------------------------------------------------------------------
def _holds_exactly(model, cache, tokens) -> bool:
    """The cache's committed entries are those of one fresh prefill of `tokens` (fp32 summation-order noise aside)."""
    fresh = model.make_cache(len(tokens) + 4)
    model(mx.array([tokens]), fresh)
    fresh.advance(len(tokens))
    mx.eval(*fresh.state())
    return cache.offset == len(tokens) and all(
        mx.abs(cache.committed(i)[0] - fresh.committed(i)[0]).max().item() < 1e-3
        for i in (0, model.args.num_hidden_layers - 1))


@pytest.fixture(scope="module")
def lm(target):
    from mlx_redrafter import api

    drafter, name = api.resolve_drafter("default", target)
    return api.LoadedModel(target, drafter, name)


@pytest.mark.parametrize("draft", ["none", "lookup-else-rnn", "rnn"])
@pytest.mark.parametrize("ending", ["eos", "max_tokens", "closed", "interrupted"])
def test_after_any_generation_the_cache_holds_history_prompt_and_every_emitted_token(lm, draft, ending):
    from mlx_redrafter import api

    model, tok = lm.target.model, lm.tokenizer
    history = tok.encode_chat([{"role": "user", "content": "Hi!"}])
    cache = model.make_cache(64)
    model(mx.array([history]), cache)
    cache.advance(len(history))
    prompt = tok.encode("Hello! How can I help?<|im_end|>\n<|im_start|>user\nSay yes.<|im_end|>\n"
                        "<|im_start|>assistant\n")
    max_tokens = {"eos": 64, "max_tokens": 7}.get(ending, 64)
    gen = api.stream_generate(lm, prompt, draft=draft, max_tokens=max_tokens, cache=cache, history=history)
    emitted, stop = [], ""
    try:
        for r in gen:
            emitted += r.tokens
            stop = r.record.stop if r.record is not None else stop
            if ending == "closed" and len(emitted) >= 3:
                gen.close()
                break
            if ending == "interrupted" and len(emitted) >= 3:
                gen.throw(KeyboardInterrupt)
    except KeyboardInterrupt:
        assert ending == "interrupted"
    if ending in ("eos", "max_tokens"):
        assert stop == ending
    assert _holds_exactly(model, cache, history + prompt + emitted)


class _SourceFailsOnThirdCall(RnnSource):
    """A real draft source that raises in the middle of the third step (as a buggy or interrupted source would)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.calls = 0

    def propose(self, state, length, width):
        self.calls += 1
        if self.calls == 3:
            raise _SourceFailed
        return super().propose(state, length, width)


class _SourceFailed(Exception):
    pass


def test_a_source_raising_mid_step_leaves_history_prompt_and_every_emitted_token(target):
    model, tok = target.model, target.tokenizer
    history = tok.encode_chat([{"role": "user", "content": "Hi!"}])
    cache = model.make_cache(128)
    model(mx.array([history]), cache)
    cache.advance(len(history))
    prompt = tok.encode("Hello!<|im_end|>\n<|im_start|>user\nCount to ten.<|im_end|>\n<|im_start|>assistant\n")
    source = _SourceFailsOnThirdCall(random_drafter(576, 49152, seed=1), model.embed)
    emitted = []
    with pytest.raises(_SourceFailed):
        for r in generate_speculative(model, prompt, Allocator([Slot(source, 3)]), length=4, max_tokens=64,
                                      cache=cache, history=history):
            emitted += r.tokens
    assert source.calls == 3 and len(emitted) >= 3  # the prefill's token and two steps' worth
    so_far = history + prompt + emitted
    assert cache.offset == len(so_far)
    assert _holds_exactly(model, cache, so_far)
    # Continuing from the settled cache decodes what a fresh AR generation over the whole sequence decodes.
    more = tok.encode("<|im_end|>\n<|im_start|>user\nAnd back?<|im_end|>\n<|im_start|>assistant\n")
    continued, _ = collect(generate_ar(model, more, max_tokens=12, cache=cache, history=so_far))
    fresh, _ = collect(generate_ar(model, so_far + more, max_tokens=12))
    assert continued == fresh


def test_truncate_keeps_the_first_committed_entries():
    cache = KVCache(1, 8)
    k = mx.arange(4 * 2, dtype=mx.float32).reshape(1, 1, 4, 2)
    cache.write(0, k, k)
    cache.advance(4)
    cache.truncate(2)
    assert cache.offset == 2 and cache.committed(0)[0][0, 0].tolist() == [[0, 1], [2, 3]]
    with pytest.raises(ValueError):
        cache.truncate(3)
