"""Shared fixtures: the real embedded model (float32) and MT-bench prompts, loaded once per session."""

import os

import pytest

from mlx_redrafter import install_blas

install_blas()  # as every entry point does: before any test module imports mlx.core


# Benchmarks wait up to 90 s for a load average left by finished work to decay; inside the suite the work that
# left it is this very process's earlier tests, so never wait (test_sweep_guard checks the guard itself).
os.environ.setdefault("REDRAFTER_SETTLE_S", "0")


@pytest.fixture(scope="session")
def target():
    from mlx_redrafter.models.loader import load_target

    return load_target(None, "float32")


@pytest.fixture(scope="session")
def mt_bench_prompts() -> list[str]:
    from mlx_redrafter.prompts import first_turns

    return [r["prompt"] for r in first_turns()]


@pytest.fixture(scope="session")
def chat_ids(target, mt_bench_prompts):
    """Chat-formatted token ids of the MT-bench first turns."""
    return [target.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in mt_bench_prompts]
