"""The library stands alone: it never imports the benchmark, a wheel installed outside the checkout works, and the
docs' Python examples run as written."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_library_does_not_import_bench():
    code = ("import sys, mlx_redrafter, mlx_redrafter.api, mlx_redrafter.cmd.main, mlx_redrafter.train.loop, "
            "mlx_redrafter.sweep; assert 'bench' not in sys.modules, sorted(m for m in sys.modules if 'bench' in m)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")


def run(args, cwd, env, timeout=600):
    p = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                       stdin=subprocess.DEVNULL)
    assert p.returncode == 0, f"{args}: {p.stderr[-2000:]}"
    return p


def test_wheel_installed_outside_the_checkout_works(tmp_path):
    """pip install of the built wheel into a fresh venv; its dependencies come from this venv (no network)."""
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "dist"),
         str(ROOT)], cwd=tmp_path, env=os.environ)
    wheel = next((tmp_path / "dist").glob("mlx_redrafter-*.whl"))
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path, env=os.environ)
    site = next(venv.glob("lib/python*/site-packages"))
    run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(site), str(wheel)],
        cwd=tmp_path, env=os.environ)
    deps = next(Path(p) for p in sys.path if p.endswith("site-packages") and (Path(p) / "mlx").exists())
    (site / "zz_deps.pth").write_text(str(deps) + "\n")  # dependencies only: the checkout is not on the path
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    py, work = str(venv / "bin" / "python"), tmp_path / "elsewhere"
    work.mkdir()
    where = run([py, "-c", "import mlx_redrafter, sys; print(mlx_redrafter.__file__); "
                           "import importlib.util as u; print(u.find_spec('bench'))"], cwd=work, env=env).stdout
    assert str(site) in where.splitlines()[0] and where.splitlines()[1] == "None"
    cli = [py, "-m", "mlx_redrafter.cmd.main"]
    out = run(cli + ["generate", "-p", "Say hi.", "-n", "4", "--json"], cwd=work, env=env).stdout
    assert '"drafter": "shipped:smollm2-135m"' in out  # the shipped drafter comes with the wheel
    run(cli + ["train", "--help"], cwd=work, env=env)
    run(cli + ["eval-drafter", "--num-prompts", "1", "--widths", "1", "--lengths", "2", "--max-tokens", "4"], cwd=work,
        env=env)
    chat = subprocess.run(cli + ["chat", "--max-tokens", "4"], cwd=work, env=env, input="Hi\n\n", capture_output=True,
                          text=True, timeout=300)
    assert chat.returncode == 0, chat.stderr[-2000:]
    run([py, "-m", "convert.from_torch", "--help"], cwd=work, env=env)


def _imports(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    """Module -> the modules of `packages` it imports anywhere (lazy imports and TYPE_CHECKING blocks included)."""
    import ast

    files = {".".join(f.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): f
             for pkg in packages for f in (root / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, f in files.items():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                while name and name not in files:
                    name = name.rpartition(".")[0]
                if name and name != mod and not mod.startswith(name + "."):
                    graph[mod].add(name)
    return graph


def test_no_import_circles():
    graph = _imports(ROOT, ("mlx_redrafter", "convert"))
    done: set[str] = set()

    def visit(mod: str, path: list[str]) -> None:
        if mod in path:
            raise AssertionError("import circle: " + " -> ".join(path[path.index(mod):] + [mod]))
        if mod in done:
            return
        for dep in sorted(graph[mod]):
            visit(dep, path + [mod])
        done.add(mod)

    for mod in sorted(graph):
        visit(mod, [])


def test_the_readmes_python_example_runs_at_full_speed_and_the_others_install_the_blas_first(tmp_path):
    """The README's Python example, run as written: no error and no warning (the one a reader gets who imports
    `api` before `install_blas()`: MLX then keeps its slow reference BLAS). The other pages' examples call
    `install_blas()` before they import `api` too."""
    examples = {page: re.search(r"```python\n(.*?)```", (ROOT / page).read_text(), re.S).group(1)
                for page in ("README.md", "docs/options.md", "docs/batching.md")}
    for page, code in examples.items():
        assert code.index("install_blas()") < code.index("import api"), page
    proc = subprocess.run([sys.executable, "-c", examples["README.md"].replace("max_tokens=64", "max_tokens=8")],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "MKL_NUM_THREADS": "1", "REDRAFTER_TUNED_FILE": str(tmp_path / "t.json")})
    assert proc.returncode == 0 and "warning" not in proc.stderr.lower(), proc.stderr
