"""After ReDrafter steps the committed KV cache is the one autoregressive decoding builds."""

import mlx.core as mx

from mlx_redrafter.cache import KVCache
from mlx_redrafter.decode import Stats, generate_tokens
from mlx_redrafter.drafter import random_drafter


def test_committed_cache_equals_ar_cache(target, chat_ids):
    model, prompt = target.model, chat_ids[2]
    drafter = random_drafter(576, 49152, seed=1)
    rd_cache, rd_stats = KVCache(30, 512), Stats()
    rd = sum(generate_tokens(model, prompt, drafter=drafter, beam_width=3, beam_length=4, max_tokens=20,
                             stats=rd_stats, cache=rd_cache), [])
    ar_cache = KVCache(30, 512)
    ar = sum(generate_tokens(model, prompt, max_tokens=20, cache=ar_cache), [])
    assert rd == ar and rd_stats.steps > 0
    # AR has fed every token but the last; ReDrafter has committed every token but its next g0.
    assert rd_cache.offset == ar_cache.offset == len(prompt) + 19
    # fp32 noise floor: the same cache computed a third correct way (one prefill of prompt + tokens) differs
    # from the AR cache by ~1e-5 (K/V reach |20|; matrix-vector vs matrix-matrix summation order). The
    # ReDrafter cache must be within 1e-5 or within twice that floor; a wrong commit is off by O(1).
    seq = prompt + ar[:-1]
    prefill_cache = KVCache(30, 512)
    model(mx.array([seq]), prefill_cache)
    prefill_cache.advance(len(seq))
    worst = floor = 0.0
    for layer in range(30):
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
