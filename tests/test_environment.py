"""Settings from environment variables: a malformed value is one error line, never a silent default."""

from __future__ import annotations

import pytest

from mlx_redrafter.environment import number, switch
from mlx_redrafter.errors import UserError
from tests.one_line import CLI, assert_one_line_error, run


def test_a_number_unset_or_empty_is_its_default_and_a_valid_one_is_read(monkeypatch):
    monkeypatch.delenv("REDRAFTER_TEST_N", raising=False)
    assert number("REDRAFTER_TEST_N", 90.0, 0.0) == 90.0
    monkeypatch.setenv("REDRAFTER_TEST_N", " ")
    assert number("REDRAFTER_TEST_N", 90.0, 0.0) == 90.0
    monkeypatch.setenv("REDRAFTER_TEST_N", "2.5")
    assert number("REDRAFTER_TEST_N", 90.0, 0.0) == 2.5
    monkeypatch.setenv("REDRAFTER_TEST_N", "3")
    assert number("REDRAFTER_TEST_N", 0, 1, integer=True) == 3


@pytest.mark.parametrize("value, integer", [("x", False), ("-1", False), ("nan", False), ("inf", False),
                                            ("1.5", True), ("0", True), ("two", True)])
def test_a_malformed_number_names_the_variable_and_what_it_takes(monkeypatch, value, integer):
    monkeypatch.setenv("REDRAFTER_TEST_N", value)
    with pytest.raises(UserError, match=r"REDRAFTER_TEST_N=.* is not valid; set it to a "
                                        + ("whole number >= 1" if integer else "number >= 0")):
        number("REDRAFTER_TEST_N", 1, 1 if integer else 0, integer=integer)


def test_a_switch_takes_its_known_values_in_any_case(monkeypatch):
    monkeypatch.setenv("REDRAFTER_TEST_S", " OFF ")
    assert switch("REDRAFTER_TEST_S", ("auto", "off")) == "off"
    monkeypatch.setenv("REDRAFTER_TEST_S", "of")
    with pytest.raises(UserError, match="use one of: auto, off"):
        switch("REDRAFTER_TEST_S", ("auto", "off"))


@pytest.mark.parametrize("var, value, needle", [("REDRAFTER_THREADS", "abc", "whole number >= 1"),
                                                ("REDRAFTER_THREADS", "0", "whole number >= 1"),
                                                ("REDRAFTER_HUB_TIMEOUT", "-1", "number >= 0.1")])
def test_the_cli_says_which_variable_is_malformed(tmp_path, var, value, needle):
    args = [*CLI, "generate", "--help"] if var == "REDRAFTER_THREADS" else \
        [*CLI, "generate", "-p", "hi", "-n", "2", "-m", "HuggingFaceTB/SmolLM2-135M-Instruct"]
    p = run(args, tmp_path, **{var: value, "HF_HUB_OFFLINE": "0"})  # online: the hub probe reads the timeout
    assert_one_line_error(p, var, repr(value), needle)
