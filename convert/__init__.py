"""Checkpoint conversion between PyTorch ReDrafter drafters (Apple's format) and redrafter-mlx drafters.

    python -m convert.from_torch PATH [--out DIR] [--model M] [--dtype D] [--quantize 4|8] [--group-size G]
    python -m convert.to_torch DRAFTER_DIR --out DIR [--dtype D] [--approximate-draft-vocab] [--dequantize]

Both are entry points: importing this package installs the optimized BLAS for MLX (it must come before mlx.core is
imported; see mlx_redrafter/system/blas.py).
"""

from mlx_redrafter import install_blas

install_blas()
