"""The data job's memory setting: large MLX arrays made one after another reuse the pages freed before them
instead of faulting in fresh ones (what made laying the data engine's cache anew slow)."""

import subprocess
import sys

import pytest

SCRIPT = """
import resource, sys
from mlx_redrafter.system.memory import reuse_freed_memory
import mlx.core as mx
applied = reuse_freed_memory() if sys.argv[1] == "on" else False
x = mx.zeros((1,)); mx.eval(x)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for i in range(8):  # 64 MB each, the last one freed before the next is made
    a = mx.full((16 << 20,), float(i))
    mx.eval(a)
    del a
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(mode: str) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120, check=True)
    applied, n = out.stdout.split()
    return applied == "True", int(n)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_large_arrays_reuse_freed_pages_in_the_data_job():
    applied, reused = faults("on")
    assert applied
    _, fresh = faults("off")
    pages = 8 * (64 << 20) // 4096
    assert fresh > pages // 2  # without it: every array's pages faulted in anew
    assert reused < fresh // 3
