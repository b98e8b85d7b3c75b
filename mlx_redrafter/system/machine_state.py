"""Is the machine quiet? The guard that keeps benchmarks honest (used by mlx_redrafter.sweep and `tune`).

A measurement taken while something else uses the CPU measures that other thing. `MachineWatch` records the
load averages and every other process using more than BUSY_CPU_PERCENT of a core (from /proc: pid, name,
nice, command line) before and after a measurement, and other processes' CPU use during it. The state is
`quiet` only when no other process was busy and all other processes together used no more than
EXCESS_LOAD_PER_CORE of each core. Without /proc (macOS) the 1-minute load average stands in for the second: it may
hold no more than EXCESS_LOAD_PER_CORE per core beyond what this process accounts for. Where /proc exists the load
average is recorded but not judged: it counts runnable threads, not CPU used (a process with more threads than
cores, as MLX's stream thread beside two BLAS threads, raises it beyond its own use), and it lags a finished run by
about a minute.
"""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Any

from mlx_redrafter.environment import number

BUSY_CPU_PERCENT = 20.0  # another process above this share of one core makes the machine busy
EXCESS_LOAD_PER_CORE = 0.3  # load average beyond our own use, per core, that makes the machine busy


def _clock_ticks() -> int:
    try:
        return os.sysconf("SC_CLK_TCK")
    except (ValueError, OSError, AttributeError):
        return 100


def _proc_times() -> dict[int, tuple[str, int, int, int]] | None:
    """pid -> (command name, nice, CPU ticks used so far, parent pid) for every process; None without /proc."""
    if not os.path.isdir("/proc/self"):
        return None
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                raw = f.read()
        except OSError:  # the process ended meanwhile
            continue
        name, rest = raw[raw.index("(") + 1 : raw.rindex(")")], raw[raw.rindex(")") + 2 :].split()
        out[int(entry)] = (name, int(rest[16]), int(rest[11]) + int(rest[12]), int(rest[1]))  # + ppid
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:120]
    except OSError:
        return ""


def _others(t0: dict | None, t1: dict | None, seconds: float) -> dict[str, Any]:
    """What processes other than this one and its children (a benchmark's own workers, e.g. llama.cpp's) used between
    two samples: `busy`, those above BUSY_CPU_PERCENT of a core, and `others_cpu_percent`, all of them together
    (percent of one core). Without /proc: {"busy": None}."""
    if t0 is None or t1 is None:
        return {"busy": None}
    me, hz, out, total = os.getpid(), _clock_ticks(), [], 0.0
    for pid, (name, nice, ticks, parent) in t1.items():
        if me in (pid, parent):
            continue
        pct = 100.0 * (ticks - t0.get(pid, (name, nice, 0, parent))[2]) / hz / max(seconds, 1e-3)
        total += pct
        if pct > BUSY_CPU_PERCENT:
            out.append({"pid": pid, "name": name, "nice": nice, "cpu_percent": round(pct, 1),
                        "cmd": _cmdline(pid)})
    return {"busy": sorted(out, key=lambda p: -p["cpu_percent"]), "others_cpu_percent": round(total, 1)}


def loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def _own_cores_so_far() -> float:
    """Our contribution to the 1-minute load average so far: CPU cores used since start, weighted like it."""
    try:
        with open("/proc/self/stat") as f:
            start = int(f.read().rsplit(")", 1)[1].split()[19]) / _clock_ticks()
        with open("/proc/uptime") as f:
            age = float(f.read().split()[0]) - start
    except (OSError, ValueError, IndexError):
        return 0.0
    return time.process_time() / max(age, 1e-3) * (1 - math.exp(-age / 60))


def snapshot(interval: float = 1.0) -> dict[str, Any]:
    """The machine right now: load averages and the other busy processes (sampled over `interval` s)."""
    t0 = _proc_times()
    time.sleep(interval)
    t1 = _proc_times()
    return {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "loadavg": loadavg(), **_others(t0, t1, interval)}


def settle_seconds() -> float:
    """How long `MachineWatch.start` may wait for a load average left by finished work to decay
    (REDRAFTER_SETTLE_S, default 90; 0 = never wait)."""
    return number("REDRAFTER_SETTLE_S", 90.0, 0.0)


class MachineWatch:
    """Records the machine state before and after a measurement and other processes' CPU use during it."""

    def __init__(self, interval: float = 1.0, settle: float | None = None):
        self.interval = interval
        self.cores = os.cpu_count() or 1
        self.settle = settle_seconds() if settle is None else settle

    def start(self) -> None:
        """Take the 'before' sample; the measurement starts now. Without /proc, when the only sign of load is a
        load average (perhaps left by work that has finished), wait up to `settle` seconds for it to decay (the
        1-minute average lags by about a minute), so that back-to-back runs do not flag each other."""
        waited, t_start = 0.0, time.perf_counter()
        while True:
            self.before = snapshot(self.interval)
            self.before["own_cores"] = round(_own_cores_so_far(), 2)
            reasons = busy_reasons({"cores": self.cores, "before": self.before, "during": {}, "after": {}})
            waited = time.perf_counter() - t_start
            if not reasons or self.before.get("busy") is not None or waited >= self.settle:  # /proc: no lag
                break
            time.sleep(5.0)
        self.before["settled_s"] = round(waited, 1)
        self.t0, self.cpu0, self.ticks0 = time.perf_counter(), time.process_time(), _proc_times()

    def stop(self, warn: bool = True) -> dict[str, Any]:
        """Take the 'after' sample; returns the record with its `quiet` flag (and warns on stderr if not)."""
        seconds = time.perf_counter() - self.t0
        own = (time.process_time() - self.cpu0) / max(seconds, 1e-3)
        ticks = _proc_times()
        during = {"seconds": round(seconds, 1), "own_cores": round(own, 2),
                  **_others(self.ticks0, ticks, seconds)}
        after = snapshot(self.interval)
        after["own_cores"] = round(own, 2)
        state = {"cores": self.cores, "before": self.before, "during": during, "after": after,
                 "thresholds": {"busy_cpu_percent": BUSY_CPU_PERCENT, "excess_load_per_core": EXCESS_LOAD_PER_CORE}}
        state["reasons"] = busy_reasons(state)
        state["quiet"] = not state["reasons"]
        if warn and not state["quiet"]:
            warn_not_quiet(state)
        return state


def busy_reasons(state: dict[str, Any]) -> list[str]:
    """Why a recorded machine state is not quiet (empty: it was)."""
    procs: dict[int, dict[str, Any]] = {}
    load = []
    for when in ("before", "during", "after"):
        s = state[when]
        for p in s.get("busy") or ():
            rec = procs.setdefault(p["pid"], {**p, "when": []})
            rec["when"].append(when)
            rec["cpu_percent"] = max(rec["cpu_percent"], p["cpu_percent"])
        if s.get("others_cpu_percent") is not None:
            if s["others_cpu_percent"] > 100 * EXCESS_LOAD_PER_CORE * state["cores"]:
                load.append(f"other processes together used {s['others_cpu_percent']:.0f}% of a core {when} the "
                            f"run ({state['cores']} cores)")
        elif s.get("busy") is None and s.get("loadavg") and "own_cores" in s:  # no /proc: the load average
            excess = s["loadavg"][0] - s["own_cores"]
            if excess > EXCESS_LOAD_PER_CORE * state["cores"]:
                load.append(f"1-minute load average {s['loadavg'][0]:.2f} {when} the run: {excess:.2f} more than "
                            f"this process accounts for ({state['cores']} cores)")
    busy = [f"{p['name']} (pid {p['pid']}, nice {p['nice']}: {p['cmd'] or '?'}) used up to {p['cpu_percent']:.0f}% "
            f"of a core {'/'.join(p['when'])} the run" for p in procs.values()]
    return busy + load


def machine_now(interval: float = 0.5) -> dict[str, Any]:
    """The machine state right now, with `quiet` and `reasons` (a check before starting a measurement)."""
    before = {**snapshot(interval), "own_cores": round(_own_cores_so_far(), 2)}
    state = {"cores": os.cpu_count() or 1, "before": before, "during": {}, "after": {}}
    state["reasons"] = busy_reasons(state)
    state["quiet"] = not state["reasons"]
    return state


def warn_not_quiet(state: dict[str, Any]) -> None:
    """A loud stderr warning that timings were taken on a busy machine."""
    bar = "!" * 100
    lines = [bar, "WARNING: the machine was NOT quiet during this measurement; timings are not representative:",
             *(f"  - {r}" for r in state["reasons"]), bar]
    print("\n".join(lines), file=sys.stderr, flush=True)
