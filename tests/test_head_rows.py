"""Growing a drafter's vocabulary head (`draft/head_rows.py`, `train --head-rows`): the rows it had stay, the
tokens the target decides most often that it lacked are appended in that order, each starting from the target's
own output row carried into the head's space."""

from __future__ import annotations

import numpy as np
import pytest

from mlx_redrafter.draft.head_rows import grow_head


def test_a_grown_head_keeps_its_rows_and_appends_the_most_frequent_missing_tokens():
    rng = np.random.default_rng(0)
    V, H, E = 40, 6, 5
    target = rng.standard_normal((V, H))
    to_head = rng.standard_normal((H, E))
    vocab = np.array([3, 7, 1, 20, 5, 9, 11, 2], dtype=np.int32)
    head = (target[vocab] @ to_head).astype(np.float32)  # a head that is exactly a linear map of the target's rows
    counts = np.zeros(V)
    counts[[30, 4, 12, 7]] = [9, 5, 5, 100]  # 7 is in the head already; 4 and 12 tie (lower id first)
    rows, grown = grow_head(head, vocab, target, counts, 11)
    assert grown.dtype == vocab.dtype and grown.tolist() == [*vocab.tolist(), 30, 4, 12]
    assert rows.dtype == head.dtype and np.array_equal(rows[:8], head)
    np.testing.assert_allclose(rows[8:], target[[30, 4, 12]] @ to_head, rtol=1e-4, atol=1e-4)
    same_rows, same = grow_head(head, vocab, target, counts, 8)
    assert same_rows is head and same is vocab
    with pytest.raises(ValueError):
        grow_head(head, vocab, target, counts, 7)


def test_the_cpu_trainer_grows_the_head_of_the_drafter_it_starts_from(tmp_path):
    from one_line import assert_one_line_error, run
    from test_bad_training import REPO, train

    from mlx_redrafter.draft.redrafter import load_drafter

    shipped = REPO / "mlx_redrafter" / "drafters" / "smollm2-135m"
    before = load_drafter(shipped)
    out = tmp_path / "out"
    proc = run(train(tmp_path, "-o", str(out), "--init-from", str(shipped), "--head-rows", "8200", "--lr", "1e-9"),
               tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "head grown to 8200 rows" in proc.stderr
    assert "held out); drafter" in proc.stderr  # the grown head's coverage where it was not chosen, too
    assert "in the held-out shard" in (out / "MODEL_CARD.md").read_text()
    after = load_drafter(out)
    assert after.args.draft_vocab_size == 8200 and after.lm_head[-1].weight.shape[0] == 8200
    old = np.array(before.draft_vocab)
    new = np.array(after.draft_vocab)
    assert np.array_equal(new[:8192], old) and not set(new[8192:].tolist()) & set(old.tolist())
    for args, needle in ((["--head-rows", "100"], "--head-rows must be from the 8192 rows"),
                         (["--head-rows", "50000"], "to its vocabulary's 49152 (got 50000)"),
                         (["--head-rows", "9000", "--kind", "medusa"], "is a redrafter drafter")):
        p = run(train(tmp_path, "-o", str(tmp_path / "o2"), "--init-from", str(shipped), "--restart", *args),
                tmp_path)
        assert_one_line_error(p, needle)
    p = run(train(tmp_path, "-o", str(tmp_path / "o3"), "--head-rows", "9000", "--restart"), tmp_path)
    assert_one_line_error(p, "--head-rows grows the head of a recurrent drafter given by --init-from")


def test_head_only_training_moves_the_head_and_nothing_else(tmp_path):
    from mlx.utils import tree_flatten
    from one_line import assert_one_line_error, run
    from test_bad_training import REPO, train

    from mlx_redrafter.draft.redrafter import load_drafter

    shipped = REPO / "mlx_redrafter" / "drafters" / "smollm2-135m"
    out = tmp_path / "out"
    proc = run(train(tmp_path, "-o", str(out), "--init-from", str(shipped), "--head-rows", "8200", "--head-only",
                     "--lr", "1e-2"), tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    grown = load_drafter(out)
    before = dict(tree_flatten(load_drafter(shipped).parameters()))
    after = dict(tree_flatten(grown.parameters()))
    head = f"lm_head.{len(grown.lm_head) - 1}."  # the vocabulary projection's parameters
    assert head + "weight" in after and before.keys() == after.keys()
    for k in after:
        if not k.startswith(head) and k != "draft_vocab":
            assert np.array_equal(np.array(before[k]), np.array(after[k])), k
    w = head + "weight"
    assert not np.array_equal(np.array(before[w]), np.array(after[w][:8192]))
    p = run(train(tmp_path, "-o", str(tmp_path / "o2"), "--head-only", "--restart"), tmp_path)
    assert_one_line_error(p, "--head-only trains the head of a recurrent drafter given by --init-from")
