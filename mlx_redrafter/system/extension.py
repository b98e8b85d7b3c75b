"""Building and finding our MLX extensions: C++ primitives (csrc/*.cpp) compiled against the installed MLX into
this package as Python extensions that share MLX's array type (nanobind, in MLX's "mlx" domain).

Each extension records the MLX version it was built against beside it (`_NAME.mlx-version`): MLX's C++ classes
may change between versions, so an extension built for another MLX is not loaded (loading it could crash the
process); `make setup` builds them again.
"""

from __future__ import annotations

import glob
import importlib
import os
import subprocess
import sys
import sysconfig
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType

HERE = os.path.dirname(os.path.abspath(__file__))


def mlx_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mlx")
    except PackageNotFoundError:
        return ""


def stamp(name: str) -> str:
    """Where the MLX version extension `name` (e.g. '_attention') was built against is written."""
    return os.path.join(HERE, f"{name}.mlx-version")


def built_for(name: str) -> str:
    """The MLX version extension `name` was built against ('' if unknown)."""
    try:
        with open(stamp(name)) as f:
            return f.read().strip()
    except OSError:
        return ""


def missing(name: str, what: str) -> str:
    """'' when extension `name` (described as `what`, e.g. 'the attention kernel') is built, else why not."""
    if glob.glob(os.path.join(HERE, f"{name}*.so")):
        return ""
    return f"{what} is not built (mlx_redrafter/system/{name}*.so)"


def build(name: str, source: str, what: str, verbose: bool = True) -> bool:
    """Compile csrc/`source` against the installed MLX and nanobind into extension `name` of this package (Linux,
    g++ with C++20). Returns whether it built; a failure leaves no library behind and says so in one warning."""
    import mlx
    import nanobind

    mlx_dir = list(mlx.__path__)[0]
    nb_dir = os.path.dirname(nanobind.__file__)
    out = os.path.join(HERE, name + sysconfig.get_config_var("EXT_SUFFIX"))
    tmp = out + ".tmp"
    cmd = [os.environ.get("CXX", "g++"), "-O3", "-std=c++20", "-fPIC", "-shared", "-fvisibility=hidden",
           "-fopenmp", "-Wno-psabi", "-DNDEBUG", "-DNB_COMPACT_ASSERTIONS",
           "-DNB_DOMAIN=mlx",  # MLX's Python bindings keep their types in nanobind's "mlx" domain
           "-I" + sysconfig.get_paths()["include"], "-I" + os.path.join(nb_dir, "include"),
           "-I" + os.path.join(nb_dir, "ext", "robin_map", "include"), "-I" + os.path.join(mlx_dir, "include"),
           os.path.join(HERE, "csrc", source), os.path.join(nb_dir, "src", "nb_combined.cpp"),
           "-L" + os.path.join(mlx_dir, "lib"), "-lmlx", "-Wl,-rpath," + os.path.join(mlx_dir, "lib"), "-o", tmp]
    if verbose:
        print(f"building {what} (about a minute) ...", file=sys.stderr)
    try:
        res = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        res = subprocess.CompletedProcess(cmd, 1, "", str(e))
    if res.returncode != 0:
        if os.path.exists(tmp):
            os.remove(tmp)
        print(f"warning: {what} did not build; MLX's own operations run instead:\n" + res.stderr[-2000:],
              file=sys.stderr)
        return False
    os.replace(tmp, out)
    with open(stamp(name), "w") as f:
        f.write(mlx_version() + "\n")
    return True


class Extension:
    """One of our extensions in this process: loaded once, checked against MLX's own operations, its variant (the
    best instruction set this CPU runs) and its threads. `module` is the loaded extension, None while it is not
    active (not built, built for another MLX, not loadable, no vector variant for this CPU, or a failed check)."""

    def __init__(self, name: str, source: str, what: str, against: str, version: int):
        self.name, self.source, self.what, self.against, self.version = name, source, what, against, version
        self.module: ModuleType | None = None
        self.problem = ""
        self.expected = False  # whether `load` was told this machine is one the kernel is built for
        self.isa = ""
        self._tried = False

    def built_for(self) -> str:
        """The MLX version the extension was built against ('' if unknown)."""
        return built_for(self.name)

    def load(self, threads: int, expected: bool, check: Callable[[], str]) -> str:
        """Load and `check` the extension (once: '' when it agrees with MLX) on a machine it is `expected` to run
        on; returns why it is not active ('' when it is, or when this CPU has no vector variant)."""
        if self._tried:
            return self.problem
        self._tried, self.expected = True, expected
        self.problem = missing(self.name, self.what)
        if self.problem:
            return self.problem
        built, now = self.built_for(), mlx_version()
        if built != now:  # MLX's C++ classes may have changed: loading it could crash the process
            self.problem = f"{self.what} was built for MLX {built or 'unknown'}, this is MLX {now}"
            return self.problem
        try:
            module = importlib.import_module(f"mlx_redrafter.system.{self.name}")
        except ImportError as e:  # no nanobind ABI in common with MLX's
            self.problem = f"{self.what} does not load ({e})"
            return self.problem
        self.isa = module.set_isa("best")
        if self.isa == "base":  # no vector variant: MLX's own operations are faster
            return self.problem
        module.set_threads(max(1, threads))
        self.module = module
        try:
            bad = check()
        except Exception as e:  # e.g. a nanobind that does not share MLX's array type: the call is refused
            bad = f"{type(e).__name__}: {e}"
        if bad:
            self.module, self.problem = None, f"{self.what} disagrees with {self.against} ({bad})"
        return self.problem

    def active(self) -> bool:
        """Loaded and checked."""
        return self.module is not None

    @contextmanager
    def use_isa(self, name: str) -> Iterator[str]:
        """Run the `name` variant ('avx2', 'avx512', 'base') inside, where this CPU runs it (for tests); yields the
        variant in use."""
        before = self.isa
        self.isa = self.module.set_isa(name) if self.module is not None else ""
        try:
            yield self.isa
        finally:
            self.isa = self.module.set_isa(before) if self.module is not None else before

    def set_threads(self, n: int) -> None:
        """Threads for one call (small calls run on one)."""
        if self.module is not None:
            self.module.set_threads(max(1, n))

    def build(self, verbose: bool = True) -> bool:
        """Compile it against the installed MLX (`build`); whether it built."""
        return build(self.name, self.source, self.what, verbose)
