"""Checkpoint conversion between PyTorch ReDrafter drafters (Apple's format) and redrafter-mlx drafters.

    python -m convert.from_torch PATH [--out DIR] [--model M] [--dtype D] [--quantize 4|8] [--group-size G]
    python -m convert.to_torch DRAFTER_DIR --out DIR [--dtype D] [--approximate-draft-vocab] [--dequantize]

Importing the package changes nothing in the process. The converters move and check tensors but do no matrix
products worth a faster BLAS, so they run on MLX's own (`install_blas()` is for decoding and training).
"""
