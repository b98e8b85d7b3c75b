"""Acceptance (greedy, exact sampling, typical) on hand-made trees, and eos handling inside an accepted run."""

import mlx.core as mx
import numpy as np

from mlx_redrafter.accept import accept_exact, accept_greedy, accept_typical, truncate_at_eos
from mlx_redrafter.generate import Emitter
from mlx_redrafter.sampling import Sampling
from mlx_redrafter.tree import PAD, pack

V = 16


def logits_for(cands, target_next):
    """Logits (P, V) whose argmax after candidate slot (i, k) is target_next[i][k]."""
    tree = pack(mx.array(cands))
    un = np.array(tree.unpacker)
    out = np.zeros((tree.size, V), dtype=np.float32)
    for i, row in enumerate(target_next):
        for k, t in enumerate(row):
            if cands[i][k] != PAD:
                out[un[i, k], t] = 10.0
    return tree, mx.array(out)


def greedy(cands, target_next):
    tree, logits = logits_for(cands, target_next)
    acc = accept_greedy(mx.array(cands), tree, logits)
    return acc.matched.tolist(), acc.n.item(), acc.next_token.item()


def test_longest_accepted_prefix_wins():
    cands = [[9, 1, 2, 3], [9, 1, 2, 4], [9, 5, 6, 7]]
    # the target's argmax after each slot; candidate 1 matches 1, 2, 4 -> 3 drafts accepted, then 8
    runs, n, nxt = greedy(cands, [[1, 2, 4, 0], [1, 2, 4, 8], [1, 0, 0, 0]])
    assert runs == [2, 3, 0] and (n, nxt) == (3, 8)


def test_ties_go_to_lowest_candidate_and_nothing_accepted_is_zero():
    runs, n, nxt = greedy([[9, 1, 2], [9, 3, 4]], [[5, 5, 5], [5, 5, 5]])
    assert runs == [0, 0] and (n, nxt) == (0, 5)


def test_padded_candidates_stop_at_their_end():
    runs, n, nxt = greedy([[9, 1, PAD, PAD], [9, 1, 2, 3]], [[1, 2, 0, 0], [1, 2, 3, 7]])
    assert runs == [1, 3] and (n, nxt) == (3, 7)


def probs_for(tree, rows):
    """(P, V) distributions; rows: {packed index: {token: prob}} (others uniform over the rest)."""
    p = np.zeros((tree.size, V), dtype=np.float32)
    for a in range(tree.size):
        spec = rows.get(a, {})
        rest = 1.0 - sum(spec.values())
        free = [t for t in range(V) if t not in spec]
        p[a, free] = rest / len(free)
        for t, v in spec.items():
            p[a, t] = v
    return mx.array(p)


def test_exact_acceptance_follows_certain_children_and_never_resamples_rejected_ones():
    cands = mx.array([[9, 1, 2], [9, 3, 4]])
    tree = pack(cands)  # packed: 0:9, 1:1, 2:2, 3:3, 4:4
    # root: p(1) = 0 (always rejected), p(3) = 1 (always accepted); after 3: p(4) = 0 -> stop, sample from the rest
    node_p = probs_for(tree, {0: {1: 0.0, 3: 1.0}, 3: {4: 0.0, 11: 1.0}})
    for seed in range(5):
        acc = accept_exact(cands, tree, node_p, mx.random.key(seed))
        assert (acc.n.item(), acc.next_token.item()) == (1, 11)
        assert acc.path[:2].tolist() == [0, 3]
    # a node whose children are all rejected never emits one of them
    node_p = probs_for(tree, {0: {1: 0.0, 3: 0.0}})
    seen = {accept_exact(cands, tree, node_p, mx.random.key(s)).next_token.item() for s in range(40)}
    assert 1 not in seen and 3 not in seen and len(seen) > 3


def test_typical_acceptance_takes_the_longest_plausible_prefix():
    cands = mx.array([[9, 1, 2], [9, 3, 4]])
    tree = pack(cands)
    node_p = probs_for(tree, {0: {1: 0.5, 3: 0.4}, 1: {2: 0.01}, 3: {4: 0.9}})
    acc = accept_typical(cands, tree, node_p, Sampling(temperature=1.0, accept="typical"), mx.random.key(0))
    assert acc.matched.tolist() == [1, 2] and acc.n.item() == 2


def test_eos_inside_accepted_run_stops_emission():
    assert truncate_at_eos([4, 5, 2, 6, 7], {2}) == ([4, 5], True)
    emit = Emitter(max_tokens=100, eos_ids=[2])
    assert emit([10]) == [10]
    assert emit([11, 2, 12, 13]) == [11]  # accepted run continues past eos: cut there
    assert emit.done and emit.stop == "eos" and emit.emitted == [10, 11]


def test_max_tokens_cuts_an_accepted_run():
    emit = Emitter(max_tokens=3, eos_ids=[2])
    assert emit([1]) == [1]
    assert emit([3, 4, 5, 6]) == [3, 4]
    assert emit.done and emit.stop == "max_tokens"
