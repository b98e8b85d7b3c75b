"""Build hook for the one compiled piece: the small-GEMM library (Linux x86-64 only; see mlx_redrafter/system/blas.py).

Everything else is declared in pyproject.toml. The library is plain C loaded with ctypes, not a Python module;
where it cannot be built the package works without it (MLX then uses the BLAS for every product).
"""

import platform

from setuptools import Extension, setup

ext_modules = []
if platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64"):
    ext_modules.append(Extension("mlx_redrafter.system._smallgemm", ["mlx_redrafter/system/csrc/smallgemm.c"],
                                 extra_compile_args=["-O3", "-fopenmp"], extra_link_args=["-fopenmp", "-ldl"],
                                 optional=True))
setup(ext_modules=ext_modules)
