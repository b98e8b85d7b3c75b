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
    # Bound: 1e-5 plus a few float32 ulps of the value. K/V entries reach |20| in this model, and two
    # correct fp32 computations of the same cache (AR steps vs one prefill of the same tokens) already
    # differ by ~1.9e-5 there (matrix-vector vs matrix-matrix summation order). A wrong commit is off by O(1).
    for layer in range(30):
        for got, ref in zip(rd_cache.committed(layer), ar_cache.committed(layer)):
            assert got.dtype == ref.dtype == mx.float32
            assert mx.all(mx.abs(got - ref) <= 1e-5 + 2e-6 * mx.abs(ref)).item(), f"layer {layer}"


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
