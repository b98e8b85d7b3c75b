"""Background priority for long jobs (the data job, feature builds): lower this process's CPU share.

`os.nice` alone is not enough on Linux kernels with autogroup scheduling (the default on most desktops and
servers): CPU time is first shared between sessions, then between the processes of a session by their nice
values, so a job at nice 19 started in its own session (setsid, nohup from another shell, a terminal of its own)
still takes a full share next to an interactive session's tests or benchmarks. Setting the niceness of the
process's autogroup too makes the job yield to everything else, as its nice value says.
"""

from __future__ import annotations

import os
from pathlib import Path

AUTOGROUP = Path("/proc/self/autogroup")


def lower_priority(nice: int) -> str:
    """Add `nice` to this process's niceness and, where the kernel groups by session, to its session group's.
    Returns what was set, e.g. "nice 19, autogroup 19" (for a log line)."""
    if nice <= 0:
        return "nice unchanged"
    now = os.nice(nice)
    said = f"nice {now}"
    try:
        AUTOGROUP.write_text(f"{now}\n")
        said += f", autogroup {now}"
    except OSError:  # not Linux, autogroup off, or not permitted for this group: the process nice stands alone
        pass
    return said
