"""Command-line entry points (`redrafter-mlx ...`); the library never imports this package."""
