"""The machine underneath: BLAS loading and our small-matrix kernel, machine facts, and the busy-machine guard
that benchmarks and tuning use."""
