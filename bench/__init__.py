"""Repository tools, not installed with the package: the benchmark sweep (vs our AR and mlx-lm's AR), the
MLX vs PyTorch parity report and the PyTorch reference path. Run from the checkout: `python -m bench --help`."""
