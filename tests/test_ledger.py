"""Timing ledger: records only while active, evaluates outputs, restores instrumented functions."""

from __future__ import annotations

import sys

import mlx.core as mx

from mlx_redrafter import ledger
from mlx_redrafter.ledger import Ledger, instrument, record, span, timed


@timed("square")
def _square(x: mx.array) -> tuple[mx.array, int]:
    return x * x, 3


def _plain(x: mx.array) -> mx.array:
    return x + 1


def test_timed_records_only_when_active():
    x = mx.arange(4)
    y, k = _square(x)  # inactive: plain call, nothing recorded anywhere
    assert k == 3 and y.tolist() == [0, 1, 4, 9]
    with Ledger() as led:
        for _ in range(3):
            _square(x)
        record("external", 0.5)
        with span("block") as s:
            z = x + 2
            s.eval(z)
    names = {r["name"]: r for r in led.rows()}
    assert names["square"]["calls"] == 3
    assert names["external"]["total_s"] == 0.5 and names["block"]["calls"] == 1
    assert led.wall_s > 0 and ledger.active() is None
    assert "square" in led.table()
    with Ledger() as other:
        _square(x)
    assert other.rows()[0]["calls"] == 1 and names["square"]["calls"] == 3


def test_instrument_wraps_and_restores():
    mod = sys.modules[__name__]
    orig = mod._plain
    with instrument({mod: {"_plain": "plain"}}), Ledger() as led:
        assert mod._plain(mx.array(1)).item() == 2
    assert mod._plain is orig
    assert [r["name"] for r in led.rows()] == ["plain"]


def test_instrument_skips_already_timed():
    mod = sys.modules[__name__]
    orig = mod._square
    with instrument({mod: ["_square"]}), Ledger() as led:
        assert mod._square is orig
        mod._square(mx.array(2))
    assert [r["name"] for r in led.rows()] == ["square"]
