"""Benchmarks: W x L sweep vs AR and mlx-lm (harness/run/plots), auto-tune, PyTorch reference and parity."""
