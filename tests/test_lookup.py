"""Lookup indices (prompt n-gram lookup, suffix automaton) against brute-force searches on random texts."""

import numpy as np
import pytest

from mlx_redrafter.draft.lookup import NgramIndex, SuffixIndex


def brute_longest_earlier_match(toks):
    """Length and first end of the longest suffix of toks that also ends earlier (None if none)."""
    n = len(toks)
    for m in range(n - 1, 0, -1):
        suffix = toks[n - m:]
        for end in range(m - 1, n - 1):
            if toks[end - m + 1 : end + 1] == suffix:
                return m, end
    return None


def test_suffix_index_finds_the_longest_earlier_occurrence():
    rng = np.random.default_rng(0)
    for _ in range(200):
        toks = rng.integers(0, 4, size=rng.integers(2, 40)).tolist()
        idx = SuffixIndex()
        for t in toks:  # incremental, one token at a time
            idx.extend([t])
        want = brute_longest_earlier_match(toks)
        got = idx.candidates(3, 1)
        if want is None:
            assert got == []
        else:
            m, end = want
            assert got[0] == toks[end + 1 : end + 4]
            v = idx.link[idx.last]
            assert idx.length[v] == m
            assert idx.matched == m


def test_ngram_index_prefers_longest_then_most_recent():
    idx = NgramIndex(max_n=3)
    idx.extend([1, 2, 3, 9, 5, 2, 3, 8, 7, 1, 2, 3])
    # "1 2 3" occurred at 0..2 (then 9 5 2); "2 3" most recently at 5..6 (then 8 7 1)
    assert idx.candidates(3, 2) == [[9, 5, 2], [8, 7, 1]]


def test_a_copy_is_a_kind_of_draft_by_the_length_of_its_match():
    """A batched step prices a row by the kind of draft it makes (batch/budget.py): a copy after a longer match is
    accepted far more often, so the kind names the match (up to `KIND_MATCH` tokens)."""
    import mlx.core as mx

    from mlx_redrafter.draft.base import DecodeState
    from mlx_redrafter.draft.lookup import LookupSource

    for context, kind in (([5, 6, 7, 8, 1, 5, 6, 7, 8], "lookup4"), ([1, 2, 3, 4, 5, 6, 7, 8, 9, 2, 3], "lookup2"),
                          ([9, 4, 1, 2, 3, 4], "lookup1")):
        src = LookupSource(NgramIndex)
        src.start(context)
        state = DecodeState(tokens=context, g0=mx.array([context[-1]]), h=mx.zeros((1, 4)))
        assert src.propose(state, 3, 1) is not None and src.kind == kind
    src = LookupSource(NgramIndex)
    src.start([1, 2, 3])
    assert src.propose(DecodeState(tokens=[1, 2, 3], g0=mx.array([3]), h=mx.zeros((1, 4))), 3, 1) is None
    assert src.kind == "lookup"


def test_lookup_finds_nothing_in_new_text():
    for idx in (NgramIndex(), SuffixIndex()):
        idx.extend([1, 2, 3, 4])
        assert idx.candidates(4, 2) == []


def test_answer_table_copies_the_most_frequent_continuation():
    from mlx_redrafter.draft.lookup import AnswerIndex, AnswerTable

    # three answers (-1 ends each): after (1, 2) comes 3 4 5 twice and 3 9 once; 7 follows (2,) once
    table = AnswerTable(np.array([1, 2, 3, 4, 5, -1, 8, 1, 2, 3, 4, 5, 6, -1, 1, 2, 3, 9, -1, 2, 7, -1]))
    idx = AnswerIndex(table)
    idx.extend([50, 1, 2])
    assert idx.candidates(4, 1) == [[3, 4, 5, 6]]  # the agreeing occurrences decide each next token
    assert idx.candidates(2, 2) == [[3, 4]]  # one distinct first token: one candidate
    idx.extend([3, 9])  # (3, 9) ends an answer: nothing follows it there; (9,) alone is shorter than min_n
    assert idx.candidates(3, 2) == []
    idx.extend([60, 2, 7])  # (2, 7) is followed by the end of an answer
    assert idx.candidates(3, 1) == []
    assert AnswerIndex(table).candidates(3, 1) == []  # an empty context


def test_a_lookup_copy_grows_while_every_copied_token_is_accepted():
    import mlx.core as mx

    from mlx_redrafter.draft.base import DecodeState
    from mlx_redrafter.draft.lookup import LookupSource

    src = LookupSource(NgramIndex, max_length=9)
    tokens = [50, *range(1, 15), 99, 1]  # the context ends with 1: copy what followed the earlier 1

    def step(decided: list[int] | None = None) -> list[int]:
        if decided:
            tokens.extend(decided)
            src.extend(decided)
        state = DecodeState(tokens=tokens, g0=mx.array([tokens[-1]]), h=mx.zeros((1, 4)))
        return src.propose(state, 3, 1)[0].tolist()

    src.start(tokens)
    assert step() == [1, 2, 3]  # the step's length: 2 drafts
    assert step([2, 3, 4]) == [4, 5, 6, 7, 8]  # both accepted: 4 drafts
    assert step([5, 6, 7, 8, 9]) == [9, 10, 11, 12, 13, 14, 99, 1, 2]  # all 4 accepted: 8 (capped at 9 - 1)
    assert step([10, 11, 50]) == [50, 1, 2]  # a draft rejected: back to the step's length
    assert LookupSource(NgramIndex, max_length=2).candidate_length(3) == 3  # below the step's length: never shorter


def test_a_backup_source_proposes_only_when_the_one_it_backs_up_has_nothing():
    import mlx.core as mx

    from mlx_redrafter.draft.base import DecodeState, Slot, propose
    from mlx_redrafter.draft.lookup import AnswerIndex, AnswerTable, LookupSource

    table = AnswerTable(np.array([7, 8, 9, 10, -1]))
    plan = [Slot(LookupSource(NgramIndex), 1), Slot(LookupSource(lambda: AnswerIndex(table), "answers"), 1,
                                                     backs_up="lookup")]

    def names(tokens):
        state = DecodeState(tokens=tokens, g0=mx.array([tokens[-1]]), h=mx.zeros((1, 4)))
        for slot in plan:
            slot.source.start(tokens)
        return [name for name, _ in propose(plan, state, 3).rows]

    assert names([1, 7, 8, 2, 7, 8]) == ["lookup"]  # the context repeats (7, 8): the table stays silent
    assert names([1, 2, 3, 7, 8]) == ["answers"]  # nothing to copy from the context: the table proposes


def test_while_the_answer_follows_its_prediction_the_predictions_copy_is_the_only_draft():
    import mlx.core as mx

    from mlx_redrafter.draft.base import DecodeState, Slot, host_only, host_proposals, propose
    from mlx_redrafter.draft.lookup import LookupSource, PredictionIndex

    prediction = LookupSource(lambda: PredictionIndex([7, 8, 9, 10, 11]), "prediction", 9, LookupSource.KIND_MATCH)
    plan = [Slot(prediction, 1), Slot(LookupSource(NgramIndex), 1)]

    def step(tokens):
        state = DecodeState(tokens=tokens, g0=mx.array([tokens[-1]]), h=mx.zeros((1, 4)))
        for slot in plan:
            slot.source.start(tokens)
        host = host_proposals([plan], [state], [3])[0]
        return [name for name, _ in propose(plan, state, 3).rows], host_only(plan, host)

    assert step([1, 7, 8, 2, 7]) == (["prediction"], True)  # the answer starts as predicted: lookup sits out
    assert step([1, 5, 6, 2, 5]) == (["lookup"], True)  # it does not: context lookup proposes as usual

@pytest.mark.parametrize("content,needle", [
    (b"not a zip file", "cannot be read"),
    ("float", "1-D integer array"),
    ("out_of_vocab", "outside the model's vocabulary"),
    ("no_tokens", "cannot be read"),
])
def test_a_bad_answer_table_is_one_line(tmp_path, content, needle):
    from mlx_redrafter.draft.lookup import AnswerTable
    from mlx_redrafter.errors import UserError

    path = tmp_path / "answers.npz"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        arrays = {"float": {"tokens": np.ones(4, dtype=np.float32)},
                  "out_of_vocab": {"tokens": np.array([5, 70000, -1], dtype=np.int32)},
                  "no_tokens": {"other": np.zeros(2, dtype=np.int32)}}[content]
        np.savez(path, **arrays)
    with pytest.raises(UserError, match=needle) as e:
        AnswerTable.load(path, vocab_size=49152)
    assert "\n" not in str(e.value) and "redrafter-mlx answers" in str(e.value)


def test_a_prediction_is_copied_from_its_start_and_again_after_a_change():
    from mlx_redrafter.draft.lookup import PredictionIndex

    prediction = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    index = PredictionIndex(prediction)
    index.extend([1, 2, 3, 10])  # the context and the answer's first token, the prediction's first
    assert index.candidates(4, 2) == [[11, 12, 13, 14]]
    index.extend([11])  # the answer follows the prediction
    assert index.candidates(3, 2) == [[12, 13, 14]]
    index.extend([12, 99, 98])  # it left it: nothing to copy until its last tokens occur in the prediction again
    assert index.candidates(3, 2) == []
    index.extend([15, 16])
    assert index.candidates(3, 2) == [[17, 18, 19]]
    index.extend([17, 18, 19])
    assert index.candidates(3, 2) == []  # the prediction is used up
    other = PredictionIndex(prediction)
    other.extend([1, 2, 3, 7])  # an answer that starts elsewhere: found again by its last tokens only
    assert other.candidates(3, 2) == []
