"""Real processes for `python -m MODULE ...` runs without paying the interpreter's start each time.

The bad-input tests start the CLI ~300 times; most of each run was Python starting and importing numpy, typer,
pydantic, jinja2 and the tokenizer libraries. A fork server started once per test process imports those
third-party modules only (none of ours, nothing that reads our settings or loads MLX or a BLAS) and forks one child
per run.
The child is a real process: it takes the run's working directory, environment, argv and a fresh stdin, stdout and
stderr, then runs the module as `python -m` does; it exits through the interpreter's normal shutdown (an uncaught
exception prints its traceback and exits 1), and a native crash ends it with a signal, as it would end a fresh one.
Runs whose environment changes how the interpreter itself starts (PYTHON*, LANG, LC_*) go through `subprocess`.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
import threading

STARTUP_VARIABLES = ("PYTHON", "LANG", "LC_")
# Third-party and standard modules the CLI imports that read neither our settings nor the BLAS switches at import
# (mlx.core may only be imported after the BLAS is installed, which reads them; huggingface_hub reads HF_HOME).
PRELOAD = ("numpy", "typer", "pydantic", "annotated_types", "jinja2", "sentencepiece", "tokenizers", "logging",
           "importlib.metadata", "email.message", "zipfile", "statistics", "inspect", "json", "dataclasses")

_SERVER = r"""
import json, os, runpy, signal, sys, time
for name in PRELOAD:
    __import__(name)


def serve():
    buf = b""
    while True:
        while b"\n" not in buf:
            chunk = os.read(0, 1 << 16)
            if not chunk:
                return
            buf += chunk
        line, buf = buf.split(b"\n", 1)
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            child(req)  # never returns: the interpreter exits at its end
        deadline = time.monotonic() + req["timeout"]
        status, delay = None, 0.001
        while status is None:
            done, st = os.waitpid(pid, os.WNOHANG)
            if done:
                status = os.waitstatus_to_exitcode(st)
            elif time.monotonic() > deadline:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                os.waitpid(pid, 0)
                status = "timeout"
            else:
                time.sleep(delay)
                delay = min(delay * 2, 0.02)
        os.write(1, (json.dumps({"status": status}) + "\n").encode())


def child(req):
    os.setpgrp()  # a timeout kills the run and anything it started
    stdin = os.open(os.devnull, os.O_RDONLY)
    out = os.open(req["stdout"], os.O_WRONLY | os.O_TRUNC)
    err = os.open(req["stderr"], os.O_WRONLY | os.O_TRUNC)
    for fd, target in ((stdin, 0), (out, 1), (err, 2)):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    sys.path[0] = os.getcwd()  # what `python -m` puts first
    sys.argv = [req["module"], *req["args"]]
    runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
    sys.exit(0)


serve()
"""


class ForkServer:
    """One fork server process; `run` is `subprocess.run` for `[sys.executable, "-m", MODULE, *args]`."""

    def __init__(self) -> None:
        code = f"PRELOAD = {PRELOAD!r}\n{_SERVER}"
        self.start_env = dict(os.environ)
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=self.start_env)
        self.lock = threading.Lock()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def starts_like(self, env: dict[str, str]) -> bool:
        """Whether a fresh interpreter with `env` would start as the server did (same PYTHON*, LANG, LC_*)."""
        keys = {k for k in {*env, *self.start_env} if k.startswith(STARTUP_VARIABLES)}
        return all(env.get(k) == self.start_env.get(k) for k in keys)

    def run(self, module: str, args: list[str], env: dict[str, str], cwd: str,
            timeout: float) -> tuple[int | str, str, str]:
        """(exit status or "timeout", stdout, stderr); a status below 0 is the signal that ended the run."""
        with self.lock, tempfile.TemporaryDirectory(prefix="forkserver-") as d:
            out, err = os.path.join(d, "out"), os.path.join(d, "err")
            for p in (out, err):
                open(p, "wb").close()
            req = {"module": module, "args": args, "env": env, "cwd": cwd, "timeout": timeout, "stdout": out,
                   "stderr": err}
            self.proc.stdin.write((json.dumps(req) + "\n").encode())
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("the fork server ended")
            status = json.loads(line)["status"]
            read = lambda p: open(p, encoding="utf-8", errors="replace").read()  # noqa: E731  (as text=True reads)
            return status, read(out), read(err)

    def close(self) -> None:
        if self.alive():
            self.proc.stdin.close()
            self.proc.wait(timeout=10)


_server: ForkServer | None = None


def run_module(argv: list[str], env: dict[str, str], cwd: str, timeout: float) -> subprocess.CompletedProcess:
    """`subprocess.run(argv, capture_output=True, text=True, stdin=DEVNULL, ...)` for `python -m MODULE` argv,
    through the fork server (started on first use); other commands, and other start-up variables, through
    subprocess."""
    global _server
    if _server is None or not _server.alive():
        _server = ForkServer()
        atexit.register(_server.close)
    if not (len(argv) >= 3 and argv[0] == sys.executable and argv[1] == "-m" and _server.starts_like(env)):
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                              env=env, cwd=cwd)
    status, out, err = _server.run(argv[2], argv[3:], env, str(cwd), timeout)
    if status == "timeout":
        raise subprocess.TimeoutExpired(argv, timeout, output=out, stderr=err)
    return subprocess.CompletedProcess(argv, status, out, err)
