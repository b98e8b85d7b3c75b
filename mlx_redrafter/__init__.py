"""redrafter-mlx: exact ReDrafter speculative decoding in pure MLX.

On Linux call `install_blas()` before importing anything that imports mlx.core (the command line, the benchmark
and the tests do): MLX's Linux CPU wheel otherwise keeps its slow reference BLAS. Importing the package changes
nothing in the process.
"""

__version__ = "0.1.0"


def install_blas():
    """Load the optimized BLAS and the small-GEMM kernel for MLX (see system/blas.py); returns a `BlasStatus`."""
    from mlx_redrafter.system.blas import install

    return install()
