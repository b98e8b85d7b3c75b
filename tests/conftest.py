"""Shared fixtures: the real embedded model (float32) and MT-bench prompts, loaded once per session."""

import json
from pathlib import Path

import pytest

import mlx_redrafter  # noqa: F401  (loads the optimized BLAS before mlx.core)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def target():
    from mlx_redrafter.loader import load_target

    return load_target(None, "float32")


@pytest.fixture(scope="session")
def mt_bench_prompts() -> list[str]:
    with (ROOT / "data" / "mt_bench.jsonl").open() as f:
        return [json.loads(line)["turns"][0] for line in f if line.strip()]


@pytest.fixture(scope="session")
def chat_ids(target, mt_bench_prompts):
    """Chat-formatted token ids of the MT-bench first turns."""
    tok = target.tokenizer
    return [tok.encode(tok.chat_prompt([{"role": "user", "content": p}])) for p in mt_bench_prompts]
