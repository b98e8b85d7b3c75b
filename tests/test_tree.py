"""Prefix dedup, packing, tree mask and unpacker against hand-made beams and a brute-force construction."""

import itertools

import mlx.core as mx
import numpy as np
import pytest

from mlx_redrafter.tree import PAD, chain, pack, prefix_of, verify_mask


def brute_force(beams: np.ndarray):
    """Trie-free reference: packed list of unique prefixes in (beam, depth) order."""
    W, L = beams.shape
    index: dict[tuple, int] = {}
    tokens, depth = [], []
    for i, k in itertools.product(range(W), range(L)):
        key = tuple(beams[i, : k + 1])
        if key not in index:
            index[key] = len(tokens)
            tokens.append(beams[i, k])
            depth.append(k)
    unpacker = np.array([[index[tuple(beams[i, : k + 1])] for k in range(L)] for i in range(W)])
    P = len(tokens)
    mask = np.zeros((P, P), dtype=bool)
    for key, a in index.items():
        for k in range(len(key)):
            mask[a, index[key[: k + 1]]] = True
    return np.array(tokens), np.array(depth), unpacker, mask


def check(beams_list):
    beams = np.array(beams_list)
    tree = pack(mx.array(beams))
    tokens, depth, unpacker, mask = brute_force(beams)
    assert tree.size == len(tokens)
    np.testing.assert_array_equal(np.array(tree.tokens), tokens)
    np.testing.assert_array_equal(np.array(tree.depth), depth)
    np.testing.assert_array_equal(np.array(tree.unpacker), unpacker)
    np.testing.assert_array_equal(np.array(tree.mask), mask)
    # every beam slot unpacks to its own token
    np.testing.assert_array_equal(np.array(tree.tokens)[np.array(tree.unpacker)], beams)
    return tree


def test_paper_example_packs_twelve_tokens_into_nine():
    tree = check([[7, 3, 5, 9], [7, 3, 8, 2], [7, 4, 1, 6]])
    assert tree.size == 9


def test_identical_beams_pack_into_one_beam():
    tree = check([[5, 6, 7, 8, 9]] * 4)
    assert tree.size == 5
    assert np.array(tree.unpacker).tolist() == [[0, 1, 2, 3, 4]] * 4


def test_distinct_beams_share_only_the_first_token():
    tree = check([[1, 2, 3], [1, 4, 5], [1, 6, 7], [1, 8, 9]])
    assert tree.size == 1 + 4 * 2


def test_single_beam_is_a_causal_chain():
    tree = check([[3, 1, 4, 1, 5]])
    assert np.array(tree.mask).tolist() == np.tril(np.ones((5, 5), dtype=bool)).tolist()


@pytest.mark.parametrize("row", [[3, 1, 4, 1, 5], [3, 1, 4, PAD, PAD], [3, PAD, PAD, PAD, PAD], [3]])
def test_one_candidate_packs_without_a_sync_as_pack_does(row):
    """`chain` (one candidate of known length, no host sync) gives `pack`'s tree."""
    cands = mx.array([row], dtype=mx.int32)
    want, got = pack(cands), chain(cands, sum(t != PAD for t in row))
    assert got.size == want.size
    for field in ("tokens", "depth", "mask", "parent", "unpacker"):
        np.testing.assert_array_equal(np.array(getattr(got, field)), np.array(getattr(want, field)), err_msg=field)


def test_random_beams_match_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(30):
        W, L = rng.integers(1, 9), rng.integers(2, 7)
        beams = rng.integers(0, 3, size=(W, L))  # small alphabet: many shared prefixes
        beams[:, 0] = 11
        check(beams.tolist())


def test_prefix_of_is_batched():
    b = mx.array([[[1, 2, 3], [1, 2, 4]], [[1, 5, 6], [1, 7, 6]]])
    assert prefix_of(b).tolist() == [[[0, 0, 0], [0, 0, 1]], [[0, 0, 0], [0, 1, 1]]]


def test_verify_mask_sees_whole_context():
    tree = pack(mx.array([[1, 2], [1, 3]]))
    m = np.array(verify_mask(tree.mask, 4))
    assert m.shape == (1, 1, 3, 7)
    assert m[0, 0, :, :4].all()
    assert m[0, 0, :, 4:].tolist() == [[True, False, False], [True, True, False], [True, False, True]]


def test_padded_slots_are_never_packed():
    from mlx_redrafter.tree import PAD

    tree = pack(mx.array([[7, 3, PAD, PAD], [7, 3, 5, 9], [7, PAD, PAD, PAD]]))
    assert tree.size == 4
    assert np.array(tree.tokens).tolist() == [7, 3, 5, 9]
    assert np.array(tree.parent).tolist() == [-1, 0, 1, 2]
    assert np.array(tree.unpacker).tolist() == [[0, 1, 0, 0], [0, 1, 2, 3], [0, 0, 0, 0]]


def test_parent_is_the_ancestor_one_level_up():
    tree = check([[7, 3, 5, 9], [7, 3, 8, 2], [7, 4, 1, 6]])
    assert np.array(tree.parent).tolist() == [-1, 0, 1, 2, 1, 4, 0, 6, 7]


def test_a_pad_inside_a_candidate_ends_it():
    """Everything after a candidate's first PAD is PAD, by construction: a stray PAD-valued id cannot splice the
    tokens after it onto the root."""
    from mlx_redrafter.tree import PAD

    tree = pack(mx.array([[7, 3, PAD, 9, 4], [7, 5, 6, PAD, 8]]))
    cut = pack(mx.array([[7, 3, PAD, PAD, PAD], [7, 5, 6, PAD, PAD]]))
    for field in ("tokens", "depth", "mask", "parent", "unpacker"):
        assert np.array(getattr(tree, field)).tolist() == np.array(getattr(cut, field)).tolist(), field
    depth, parent = np.array(tree.depth), np.array(tree.parent)
    assert tree.size == 4 and all(depth[parent[i]] == depth[i] - 1 for i in range(1, tree.size))


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_a_pad_inside_a_candidate_keeps_tokens_and_cache_in_step(target, temperature):
    """A candidate [g0, x, PAD, a1, a2] with x a token the target rejects and a1 its own choice: the step emits
    what it would for the candidate cut at the PAD, and commits exactly as many KV entries as it emits tokens
    (before, a1 became a child of the root at depth 3 and exact acceptance committed entries it never emitted)."""
    from mlx_redrafter.draft.base import DecodeState, Slot, Source
    from mlx_redrafter.sampling import Rng, Sampling
    from mlx_redrafter.step import prefill, speculative_step
    from mlx_redrafter.tree import PAD

    model, sampling = target.model, Sampling(temperature=temperature)
    prompt = target.tokenizer.encode_chat([{"role": "user", "content": "Count from one to ten."}])

    class Fixed(Source):
        name, cands = "fixed", None

        def propose(self, state, length, width):
            return self.cands

    results = []
    for cut in (False, True):
        cache = model.make_cache(len(prompt) + 16)
        g0, h = prefill(model, cache, prompt)
        logits, _ = model(g0[:, None], cache.copy())  # the target's distribution after g0 (on a copy)
        a1, x = int(mx.argmax(logits[0, -1])), int(mx.argmin(logits[0, -1]))
        src = Fixed()
        src.cands = mx.array([[g0.item(), x, PAD, PAD if cut else a1, PAD if cut else a1]], dtype=mx.int32)
        before = cache.offset
        step = speculative_step(model, cache, DecodeState(prompt + [g0.item()], g0, h), [Slot(src, 1)], 5,
                                sampling, Rng(0))
        assert cache.offset - before == len(step.tokens) == step.accepted + 1
        results.append((step.tokens, cache.offset))
    assert results[0] == results[1]
