"""Checkpoint conversion between PyTorch ReDrafter drafters (Apple's format) and redrafter-mlx drafters.

    python -m convert.from_torch PATH [--out DIR] [--model M] [--dtype D] [--quantize 4|8] [--group-size G]
    python -m convert.to_torch DRAFTER_DIR --out DIR [--dtype D] [--approximate-draft-vocab] [--dequantize]
"""
