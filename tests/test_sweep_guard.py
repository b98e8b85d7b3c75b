"""The machine-state guard (mlx_redrafter.system.machine_state) in a real sweep: a busy machine is flagged, and tune
refuses to store its result."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

from mlx_redrafter import sweep
from mlx_redrafter.api import LoadedModel
from mlx_redrafter.cmd.app import app

SPIN = ("import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'while True: pass']); "
        "print(p.pid, flush=True); sys.stdin.read(); p.kill()")


@pytest.fixture()
def spinner():
    """Another process burning one core for the duration of a test (always killed): not a child of this one, whose
    children the guard counts as the measurement's own workers (a benchmark's llama.cpp process)."""
    parent = subprocess.Popen([sys.executable, "-c", SPIN], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        pid = int(parent.stdout.readline())
        time.sleep(0.5)
        yield type("Spinner", (), {"pid": pid})
    finally:
        parent.stdin.close()
        parent.wait(timeout=10)


def test_a_measurements_own_worker_is_not_another_process():
    from mlx_redrafter.system.machine_state import snapshot

    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        assert child.pid not in [p["pid"] for p in snapshot(0.5)["busy"]]
    finally:
        child.kill()
        child.wait(timeout=10)


def test_busy_machine_is_flagged(target, spinner, capsys):
    lm = LoadedModel(target=target, drafter=None, drafter_name="none")
    configs = sweep.grid_configs(["lookup"], [1], [2], max_tokens=3)
    res = sweep.sweep(lm, [{"prompt": "Say hi."}], configs, warmup_tokens=2, watch_interval=0.5)
    state = res.machine_state
    assert not res.quiet and state["quiet"] is False
    for when in ("before", "during", "after"):
        assert spinner.pid in [p["pid"] for p in state[when]["busy"]], (when, state)
    assert any(f"pid {spinner.pid}" in r for r in state["reasons"])
    assert f"pid {spinner.pid}" in capsys.readouterr().err  # the loud warning
    assert [r["config"] for r in res.rows] == ["ar", "lookup-w1-l2"] and all(r["equal_ar"] for r in res.rows)


def test_tune_refuses_to_store_on_a_busy_machine(tmp_path, monkeypatch, spinner):
    tuned = tmp_path / "tuned.json"
    monkeypatch.setenv("REDRAFTER_TUNED_FILE", str(tuned))
    res = CliRunner().invoke(app, ["tune", "--drafter", "random:0", "--num-prompts", "1", "-n", "3"])
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert res.exit_code == 2 and len(lines) == 1, res.output
    assert lines[0].startswith("error: the machine is busy") and f"pid {spinner.pid}" in lines[0]
    assert "--force" in lines[0] and not tuned.exists()


def test_a_busy_process_is_not_waited_out(spinner):
    """The settle wait is only for a load average left by finished work; a process busy now is reported at once."""
    from mlx_redrafter.system.machine_state import MachineWatch

    watch = MachineWatch(interval=0.5, settle=60)
    watch.start()
    assert watch.before["settled_s"] < 5
    assert spinner.pid in [p["pid"] for p in watch.before["busy"]]


def test_what_makes_a_recorded_state_busy():
    """With /proc, other processes' CPU use is judged and the load average only recorded (it counts runnable
    threads, our own beyond the cores included, and lags a finished run); without /proc the load average is judged."""
    from mlx_redrafter.system.machine_state import busy_reasons

    def state(**during):
        quiet = {"loadavg": [2.6, 2.3, 2.4], "own_cores": 1.9, "busy": [], "others_cpu_percent": 3.0}
        return {"cores": 2, "before": dict(quiet), "during": {"busy": [], "others_cpu_percent": 3.0, **during},
                "after": dict(quiet)}

    assert busy_reasons(state()) == []
    reasons = busy_reasons(state(others_cpu_percent=75.0))
    assert len(reasons) == 1 and "other processes together used 75% of a core during the run" in reasons[0]
    no_proc = {"cores": 2, "before": {"loadavg": [2.6], "own_cores": 1.9, "busy": None}, "during": {"busy": None},
               "after": {"loadavg": [1.0], "own_cores": 0.9, "busy": None}}
    reasons = busy_reasons(no_proc)
    assert len(reasons) == 1 and reasons[0].startswith("1-minute load average 2.60 before the run")
