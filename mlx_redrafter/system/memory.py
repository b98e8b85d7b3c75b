"""Large buffers served from freed memory instead of fresh pages, for the data job (`redrafter-mlx distill`) and
drafter training (`redrafter-mlx train`).

glibc serves every allocation over 32 MB with an mmap of its own and unmaps it on free, and MLX's CPU allocator
keeps for reuse only buffers of the very size asked again (and at most 32 MB of them). The data engine lays its
64-row KV cache anew whenever rows join or leave (60 arrays of ~50 MB at 900 slots, one layer at a time), so every
new array faulted its pages in one at a time, each zeroed by the kernel first: those copies ran at ~1 GB/s on a
Zen 3 core. With glibc's mmap off, a freed array's memory stays in the heap and the next array takes it: dropping
16 of 64 rows and joining 16 new ones took 0.35 + 0.88 s instead of 2.1 + 3.3 s
(bench/results/cpu-avx2/key-windows-20261130/). A training step (1,024 contexts x 5 draft steps, soft labels,
the shipped drafter's shape; its logits alone are 168 MB) took 4.4 s instead of 4.8-5.0 s on one thread. The
price: freed memory goes back to the system only from the top of the heap (above `trim_mb`), so a long job's
resident size stays near its peak.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_MAX = -4


def reuse_freed_memory(trim_mb: int = 512) -> bool:
    """For this process: serve large allocations from the heap and give back freed heap top above `trim_mb` MB.
    Returns whether it applied (Linux with glibc; elsewhere nothing changes)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, trim_mb << 20))
