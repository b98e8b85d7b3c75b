"""The fork server runs `python -m MODULE` as a fresh interpreter would: the bad-input contract (one error line, exit
2, no traceback, no signal, no hang) is judged on what it reports."""

import os
import signal
import subprocess
import sys

import pytest
from forkserver import run_module

PROBE = """
import json, os, sys
what = sys.argv[1]
if what == "report":
    print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "env": os.environ.get("PROBE_VALUE"),
                      "path0": sys.path[0], "main": __name__, "stdin": sys.stdin.read(),
                      "optimize": sys.flags.optimize}))
elif what == "exit":
    sys.stderr.write("bye\\n")
    sys.exit(int(sys.argv[2]))
elif what == "raise":
    raise ValueError("boom")
elif what == "crash":
    os.kill(os.getpid(), 11)
elif what == "hang":
    import time
    time.sleep(60)
"""


def probe(tmp_path, *args, timeout=30, **env):
    (tmp_path / "probe_mod.py").write_text(PROBE)
    return run_module([sys.executable, "-m", "probe_mod", *args], {**os.environ, **env}, str(tmp_path), timeout)


def test_a_run_gets_its_own_argv_cwd_environment_and_empty_stdin(tmp_path):
    import json

    got = json.loads(probe(tmp_path, "report", "caf\udce9", PROBE_VALUE="x=1").stdout)
    assert got["argv"][1:] == ["report", "caf\udce9"] and got["argv"][0].endswith("probe_mod.py")
    assert got["cwd"] == got["path0"] == str(tmp_path) and got["env"] == "x=1"
    assert got["main"] == "__main__" and got["stdin"] == ""
    assert json.loads(probe(tmp_path, "report").stdout)["env"] is None  # nothing left from the run before


def test_exit_status_traceback_and_signal_are_a_fresh_interpreters(tmp_path):
    p = probe(tmp_path, "exit", "2")
    assert (p.returncode, p.stderr) == (2, "bye\n")
    p = probe(tmp_path, "raise")
    assert p.returncode == 1 and "Traceback" in p.stderr and "ValueError: boom" in p.stderr
    assert probe(tmp_path, "crash").returncode == -signal.SIGSEGV


def test_a_hang_is_killed_at_the_timeout(tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        probe(tmp_path, "hang", timeout=1)
    assert probe(tmp_path, "exit", "0").returncode == 0  # the server goes on


def test_a_changed_interpreter_setting_runs_in_a_fresh_process(tmp_path):
    import json

    assert json.loads(probe(tmp_path, "report", PYTHONOPTIMIZE="1").stdout)["optimize"] == 1
