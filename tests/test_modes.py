"""Draft modes are one table: every row decodes exactly through the API, `auto` and the missing-drafter rule come
from the rows, and a mode added in a table of the test's own runs without touching the library."""

from __future__ import annotations

import pytest

from mlx_redrafter import api
from mlx_redrafter.draft.medusa import random_medusa
from mlx_redrafter.draft.modes import AUTO, MODES, Mode, resolve
from mlx_redrafter.draft.semi_ar import random_semi_ar
from mlx_redrafter.errors import UserError
from mlx_redrafter.sources import SOURCE_KINDS
from tests.exactness import divergence

PROMPT = "Count from one to twelve, then name three colors."
MAX_TOKENS = 14


@pytest.fixture(scope="module")
def drafters(target):
    H, V = target.model.args.hidden_size, target.model.args.vocab_size
    shipped, _ = api.resolve_drafter("default", target)
    return {None: None, "rnn": shipped, "medusa": random_medusa(H, V, seed=0, draft_vocab_size=4096),
            "semi_ar": random_semi_ar(H, V, seed=0, draft_vocab_size=4096)}


@pytest.fixture(scope="module")
def ar(target):
    lm = api.LoadedModel(target, None, "none")
    ids = api.encode_prompt(lm, PROMPT)
    return ids, api.generate(lm, ids, draft="none", max_tokens=MAX_TOKENS).tokens


def test_every_row_names_known_sources_and_its_drafter():
    for mode in MODES.values():
        assert all(kind in SOURCE_KINDS for kind, _ in mode.sources), mode
        backed = {kind for kind, _ in mode.sources}
        assert all(b is None or b in backed for _, b in mode.sources), mode
        drafter_sources = {kind for kind, _ in mode.sources if kind in ("rnn", "medusa", "semi_ar")}
        assert drafter_sources == ({mode.drafter} if mode.drafter else set()), mode
    for kind in ("none", "rnn", "medusa", "semi_ar"):  # `auto` is exactly one row per drafter kind
        assert len([m for m in MODES.values() if kind in m.auto_for]) == 1


@pytest.mark.parametrize("name", list(MODES))
def test_every_mode_decodes_exactly_through_the_api(target, drafters, ar, name):
    mode = MODES[name]
    ids, expected = ar
    lm = api.LoadedModel(target, drafters[mode.drafter], mode.drafter or "none")
    res = api.generate(lm, ids, draft=name, max_tokens=MAX_TOKENS, answers_width=1)
    assert divergence(target.model, ids, expected, res.tokens) is None
    assert res.settings["draft"] == name
    assert set(res.stats.source_proposed) <= {kind for kind, _ in mode.sources}
    if not mode.drafts:
        assert res.stats.verified_tokens == 0  # plain AR: no packed verification
    elif mode.drafter is not None:
        assert res.stats.verified_tokens > res.stats.steps  # the drafter proposes every step


def test_auto_and_a_missing_drafter_follow_the_rows(target, drafters):
    for kind in (None, "rnn", "medusa", "semi_ar"):
        assert resolve(AUTO, kind, "m", "d").auto_for == ((kind or "none"),)
    for mode in (m for m in MODES.values() if m.drafter):
        with pytest.raises(UserError, match="needs a .* drafter, but none is loaded for m: pass --drafter DIR"):
            resolve(mode.name, None, "m", "d")
        other = next(k for k in ("rnn", "medusa", "semi_ar") if k != mode.drafter)
        with pytest.raises(UserError, match="but d is a .* drafter"):
            resolve(mode.name, other, "m", "d")


def test_a_mode_of_the_tests_own_table_runs_through_the_api(target, drafters):
    """One row, nothing else: the ReDrafter backs up suffix-automaton lookup (no answer table)."""
    table = {"suffix-else-rnn": Mode("suffix-else-rnn", (("lookup", None), ("rnn", "lookup")), drafter="rnn")}
    lm = api.LoadedModel(target, drafters["rnn"], "shipped")
    ids = api.encode_prompt(lm, "Repeat this sentence twice: the quick brown fox jumps over the lazy dog.")
    expected = api.generate(lm, ids, draft="none", max_tokens=32).tokens
    res = api.generate(lm, ids, draft=table["suffix-else-rnn"], lookup="suffix", max_tokens=32)
    assert divergence(target.model, ids, expected, res.tokens) is None
    assert res.settings["draft"] == "suffix-else-rnn" and res.settings["lookup"] == "suffix"
    assert set(res.stats.source_proposed) == {"lookup", "rnn"} and res.settings["answers_width"] == 0
    assert [(s.source.name, s.backs_up) for s in api.make_allocator(lm, api.decode_options(
        draft=table["suffix-else-rnn"])).slots] == [("lookup", None), ("rnn", "lookup")]


def test_a_sweep_measures_by_default_the_swept_rows_the_drafter_serves():
    from mlx_redrafter.sweep import sweep_drafts

    assert sweep_drafts(None, None) == ["lookup"]
    assert sweep_drafts(None, "rnn") == ["rnn", "lookup", "rnn+lookup", "lookup-else-rnn"]
    assert sweep_drafts(None, "medusa") == ["lookup", "medusa"]
    assert sweep_drafts(None, "semi_ar") == ["lookup", "semi_ar"]
    assert sweep_drafts("medusa,lookup", "medusa") == ["medusa", "lookup"]
    with pytest.raises(UserError, match="--drafts rnn need a ReDrafter .rnn. drafter, and a Medusa drafter is"):
        sweep_drafts("rnn,lookup", "medusa")
    with pytest.raises(UserError, match="--drafts medusa need a Medusa drafter, and there is none"):
        sweep_drafts("medusa", None)


def test_sweep_configs_take_a_mode_of_the_tests_own_table():
    from mlx_redrafter.sweep import config_name, grid_configs

    mine = Mode("suffix-else-rnn", (("lookup", None), ("rnn", "lookup")), drafter="rnn")
    configs = grid_configs([mine], [1], [3], max_tokens=4)
    assert [c.name for c in configs] == ["ar", "suffix-else-rnn-w1-l3"]
    assert [c.is_ar for c in configs] == [True, False]
    assert config_name(MODES["none"]) == "ar"


def test_sweep_configs_vary_the_lookup_index_of_the_lookup_modes_only():
    """Cells are named by the index only where it is not the mode's own (None: the mode's own)."""
    from mlx_redrafter.sweep import grid_configs

    own = MODES["lookup-else-rnn"].lookup_index
    other = next(i for i in ("ngram", "ngram2") if i != own)
    configs = grid_configs(["lookup-else-rnn", "rnn"], [1], [3], max_tokens=4, lookup_indexes=(None, other))
    names = {c.name: c.options.lookup.index for c in configs if c.options.draft != "none"}
    assert names == {"lookup-else-rnn-w1-l3": None, f"lookup-else-rnn-w1-l3-i{other}": other, "rnn-w1-l3": None}


def test_a_mode_copies_by_its_own_lookup_index_unless_one_is_named():
    """lookup-else-rnn copies only after a match of two tokens (its drafter beats a copy after one), lookup alone
    after one; --lookup names the index for every mode, and the settings say which ran."""
    from mlx_redrafter.options import decode_options
    from mlx_redrafter.sources import for_mode

    assert MODES["lookup-else-rnn"].lookup_index == "ngram2" and MODES["lookup"].lookup_index == "ngram"
    for mode in ("lookup-else-rnn", "lookup", "rnn+lookup"):
        assert for_mode(MODES[mode], decode_options()).lookup.index == MODES[mode].lookup_index
        assert for_mode(MODES[mode], decode_options(lookup="suffix")).lookup.index == "suffix"
