"""redrafter-mlx: exact ReDrafter speculative decoding in pure MLX."""

from mlx_redrafter.system.blas import load_optimized_blas

load_optimized_blas()  # must run before mlx.core is imported anywhere

__version__ = "0.1.0"
