"""Greedy acceptance and eos handling inside an accepted run."""

import mlx.core as mx

from mlx_redrafter.accept import accept_greedy, truncate_at_eos
from mlx_redrafter.decode import Stats, _Emitter


def test_longest_accepted_prefix_wins():
    beams = mx.array([[9, 1, 2, 3], [9, 1, 2, 4], [9, 5, 6, 7]])
    # target's argmax after each slot; beam 1 matches 1,2,4 -> 3 drafts accepted
    target = mx.array([[1, 2, 0, 0], [1, 2, 4, 8], [1, 0, 0, 0]])
    best, n = accept_greedy(beams, target)
    assert (best.item(), n.item()) == (1, 3)


def test_ties_go_to_lowest_beam_and_nothing_accepted_is_zero():
    beams = mx.array([[9, 1, 2], [9, 3, 4]])
    best, n = accept_greedy(beams, mx.array([[5, 5, 5], [5, 5, 5]]))
    assert (best.item(), n.item()) == (0, 0)


def test_eos_inside_accepted_run_stops_emission():
    assert truncate_at_eos([4, 5, 2, 6, 7], {2}) == ([4, 5], True)
    stats = Stats()
    emit = _Emitter(stats, max_tokens=100, eos_ids=[2])
    assert emit([10]) == [10]
    assert emit([11, 2, 12, 13]) == [11]  # accepted run continues past eos: cut there
    assert emit.done and stats.stop_reason == "eos" and stats.generated_tokens == 2


def test_max_tokens_cuts_an_accepted_run():
    stats = Stats()
    emit = _Emitter(stats, max_tokens=3, eos_ids=[2])
    assert emit([1]) == [1]
    assert emit([3, 4, 5, 6]) == [3, 4]
    assert emit.done and stats.stop_reason == "max_tokens"
