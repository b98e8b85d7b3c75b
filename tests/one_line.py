"""Running the real CLI on bad input, and the contract it must keep: exactly one `error: ...` line on stderr, exit
status 2, no traceback, no native crash (a signal), no hang (a subprocess timeout)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from forkserver import run_module

CLI = [sys.executable, "-m", "mlx_redrafter.cmd.main"]
TIMEOUT = 120  # seconds: a hang guard on a busy 2-core machine (the commands here take 1-5 s)


def cli_env(tmp: Path, **extra: str) -> dict[str, str]:
    """The environment of a CLI run: no tuned settings file, an offline and empty Hugging Face cache, one BLAS
    thread."""
    env = dict(os.environ, REDRAFTER_TUNED_FILE=str(tmp / "no-tuned.json"), HF_HUB_OFFLINE="1",
               HF_HOME=str(tmp / "hf"), MKL_NUM_THREADS="1")
    env.update(extra)
    return env


def run(args: list[str], tmp: Path, timeout: int = TIMEOUT, **env: str) -> subprocess.CompletedProcess:
    """`args` run as a real process (e.g. CLI + [...]) with `cli_env`, as `subprocess.run` would run it (a
    `python -m` command is forked from a server that has imported its third-party modules: forkserver.py)."""
    return run_module(args, cli_env(tmp, **env), str(tmp), timeout)


def generate(tmp: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """`redrafter-mlx generate -p hi -n 4 ARGS...`."""
    return run([*CLI, "generate", "-p", "hi the", "-n", "4", *args], tmp, **env)


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """The one-line contract; returns the message (after `error: `)."""
    assert proc.returncode >= 0, f"killed by signal {-proc.returncode} (a native crash): {proc.stderr[-2000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0][len("error: "):]
