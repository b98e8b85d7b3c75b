"""The BLAS switch is explicit and loud: importing the library changes nothing, `install_blas` loads what the two
independent switches ask for, and a kernel expected on this machine but missing is one warning line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.one_line import CLI, assert_one_line_error, run
from tests.test_small_gemm import EXPECTED

REPO = Path(__file__).resolve().parent.parent
BENCH = [sys.executable, "-m", "bench"]

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the BLAS preload exists only on Linux")

PROBE = ("import json, mlx_redrafter{imports}; maps = open('/proc/self/maps').read(); before = ('libmkl' in maps, "
         "'_smallgemm' in maps); st = mlx_redrafter.install_blas(){after}; maps = open('/proc/self/maps').read(); "
         "print(json.dumps({{'before': before, 'after': ('libmkl' in maps, '_smallgemm' in maps), "
         "'status': st.as_dict()}}))")


def probe(imports: str = "", after: str = "", **env: str) -> tuple[dict, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("REDRAFTER_")}
    p = subprocess.run([sys.executable, "-c", PROBE.format(imports=imports, after=after)], capture_output=True,
                       text=True, env={**clean, **env}, check=True)
    return json.loads(p.stdout), p.stderr


def test_importing_the_library_leaves_the_process_blas_alone():
    p = subprocess.run([sys.executable, "-c", "import mlx_redrafter, mlx_redrafter.api, mlx_redrafter.sweep, "
                        "mlx_redrafter.train.loop, convert.from_torch, convert.to_torch; "
                        "maps = open('/proc/self/maps').read(); "
                        "print('libmkl' in maps, '_smallgemm' in maps)"], capture_output=True, text=True, check=True)
    assert p.stdout.split() == ["False", "False"] and p.stderr == ""


def test_install_loads_the_blas_and_the_kernel():
    got, err = probe()
    assert got["before"] == [False, False] and err == ""
    assert got["after"][0] and got["status"]["blas"].startswith("libmkl_rt")
    assert got["status"]["small_gemm"] == got["after"][1] == EXPECTED


def test_the_two_switches_are_independent():
    got, _ = probe(REDRAFTER_BLAS="off")
    assert got["status"]["blas"] == "mlx-default" and not got["after"][0]
    assert got["status"]["small_gemm"] == EXPECTED  # the kernel hands big products to MLX's own BLAS
    got, _ = probe(REDRAFTER_SMALL_GEMM="off")
    assert got["status"]["blas"].startswith("libmkl_rt") and not got["status"]["small_gemm"]
    assert not got["after"][1]


OTHER_LIBRARY = sorted((REPO / "mlx_redrafter" / "system").glob("_attention*.so"))  # a library, not the kernel


@pytest.mark.skipif(not EXPECTED, reason="the kernel is not built for this machine")
@pytest.mark.parametrize("library, problem", [("missing.so", "missing.so does not exist"),
                                              ("other", "is not the small-GEMM kernel (it lacks")])
def test_a_missing_kernel_is_one_warning_line_and_the_cli_still_runs(tmp_path, library, problem):
    env = {k: v for k, v in os.environ.items() if not k.startswith("REDRAFTER_")}
    if library == "other" and not OTHER_LIBRARY:
        pytest.skip("the attention kernel is not built")
    env["REDRAFTER_SMALL_GEMM_LIB"] = str(tmp_path / library if library != "other" else OTHER_LIBRARY[0])
    p = subprocess.run([sys.executable, "-m", "mlx_redrafter.cmd.main", "generate", "-p", "Hi", "-n", "2",
                        "--no-draft", "--json"], capture_output=True, text=True, env=env, timeout=300,
                       stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("warning: the small-GEMM kernel is not active"), lines
    assert problem in lines[0] and "REDRAFTER_SMALL_GEMM=off" in lines[0]
    record = json.loads(p.stdout.splitlines()[-1])
    assert record["blas"].startswith("libmkl_rt") and "smallgemm" not in record["blas"]
    full = record["blas_status"]
    assert full["small_gemm_expected"] and not full["small_gemm"] and problem in full["problem"]


@pytest.mark.parametrize("var, value, allowed", [("REDRAFTER_BLAS", "mkk", "auto, mkl, openblas, off"),
                                                 ("REDRAFTER_SMALL_GEMM", "offf", "auto, on"),
                                                 ("REDRAFTER_ATTENTION_KERNEL", "fast", "auto, off"),
                                                 ("REDRAFTER_PACKED_WEIGHTS", "packed", "auto, off"),
                                                 ("REDRAFTER_VECTOR_MATH", "fast", "auto, off"),
                                                 ("REDRAFTER_STEP_COSTS", "timed", "auto, measured, curve"),
                                                 ("REDRAFTER_DRAFT_WEIGHTS", "q8", "auto, int8, float16, float32")])
def test_an_unknown_switch_value_is_one_error_line(tmp_path, var, value, allowed):
    for args in ([*CLI, "generate", "--help"], [*BENCH, "sweep", "--help"]):
        p = run(args, tmp_path, **{var: value}, PYTHONPATH=str(REPO))
        assert_one_line_error(p, var, repr(value), allowed)


def test_the_json_record_holds_the_full_blas_status(tmp_path):
    p = run([*CLI, "generate", "-p", "Hi", "-n", "2", "--no-draft", "--json"], tmp_path)
    assert p.returncode == 0, p.stderr
    full = json.loads(p.stdout.splitlines()[-1])["blas_status"]
    assert set(full) == {"installed", "blas", "small_gemm", "small_gemm_version", "small_gemm_expected",
                         "attention_kernel", "packed_weights", "vector_math", "problem"}
    assert full["installed"] and full["small_gemm"] == EXPECTED


KERNELS = [("attention_kernel", "REDRAFTER_ATTENTION_KERNEL", "+attn", "the attention kernel"),
           ("packed_linear", "REDRAFTER_PACKED_WEIGHTS", "+packed", "the packed-weight kernel"),
           ("vector_math", "REDRAFTER_VECTOR_MATH", "+vmath", "the vector-math kernels")]


@pytest.mark.parametrize("module, switch, tag, what", KERNELS)
def test_an_extension_switched_off_is_not_loaded_and_says_nothing(module, switch, tag, what):
    code = ("import mlx_redrafter; s = mlx_redrafter.install_blas(); "
            f"from mlx_redrafter.system import {module} as k; print(k.KERNEL.active(), '{tag}' in s.describe())")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, **{switch: "off"}))
    assert res.returncode == 0 and res.stdout.split() == ["False", "False"] and "warning" not in res.stderr


@pytest.mark.parametrize("module, switch, tag, what", KERNELS)
def test_an_extension_built_for_another_mlx_is_not_loaded_and_one_warning_line_says_so(module, switch, tag, what):
    if not EXPECTED:
        pytest.skip("our kernels are not built for this machine")
    code = (f"from mlx_redrafter.system import {module} as k; k.KERNEL.built_for = lambda: '0.0.1'; "
            "import mlx_redrafter; s = mlx_redrafter.install_blas(); "
            f"print(k.KERNEL.active(), '{tag}' in s.describe())")
    env = {k: v for k, v in os.environ.items() if k != switch}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0 and res.stdout.split() == ["False", "False"], res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"warning: {what} was built for MLX 0.0.1"), lines
    assert f"python -m mlx_redrafter.system.{module}" in lines[0] and f"{switch}=off" in lines[0]


@pytest.mark.parametrize("module", ["attention_kernel", "packed_linear"])
def test_decoding_is_the_same_with_and_without_each_kernel(module, target, chat_ids):
    import importlib

    from kernels import require, without

    from mlx_redrafter.generate import collect, generate_ar

    ext = importlib.import_module(f"mlx_redrafter.system.{module}").KERNEL
    require(ext)
    model, eos = target.model, target.tokenizer.eos_ids
    fast, _ = collect(generate_ar(model, chat_ids[0], max_tokens=48, eos_ids=eos))
    with without(ext):
        plain, _ = collect(generate_ar(model, chat_ids[0], max_tokens=48, eos_ids=eos))
    assert fast == plain

