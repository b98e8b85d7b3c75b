"""Benchmark harness (W x L sweep vs AR and mlx-lm, CSV/JSON/plots) and auto-tune for redrafter-mlx."""
