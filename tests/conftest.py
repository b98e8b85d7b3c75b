"""Shared fixtures: the real embedded model (float32) and MT-bench prompts, loaded once per session."""

import os

import pytest

from mlx_redrafter import install_blas

install_blas()  # as every entry point does: before any test module imports mlx.core


# Benchmarks wait up to 90 s for a load average left by finished work to decay; inside the suite the work that
# left it is this very process's earlier tests, so never wait (test_sweep_guard checks the guard itself).
os.environ.setdefault("REDRAFTER_SETTLE_S", "0")


_loaded: list = []  # the session's target once a test asked for it


@pytest.fixture(scope="session")
def target():
    from mlx_redrafter.models.loader import load_target

    _loaded.append(load_target(None, "float32"))
    return _loaded[0]


@pytest.fixture(scope="module", autouse=True)
def bare_target_per_module():
    """Each test module starts with the session's target returning its last state alone. Pairing the target with
    a drafter that fuses target layers (the shipped one does) makes its forward return those layers too, and that
    must not leak into whichever module a worker runs next."""
    for t in _loaded:
        t.model.feature_layers = ()


@pytest.fixture(scope="session")
def hf(tmp_path_factory, worker_id):
    """transformers' LlamaForCausalLM of the embedded model as transformers itself reads the GGUF (the PyTorch
    reference: its own parser and dequantization), from a copy without the tokenizer arrays (`model_only`: same
    tensor bytes; ~15 s instead of ~28). The first test process that needs the model saves what it read as a plain
    model directory, which the other processes of the run load in a few seconds."""
    from filelock import FileLock
    from gguf_files import model_only

    from bench.torch_ref.target import load_hf_target, save_hf_target
    from mlx_redrafter.models.loader import resolve_model

    base = tmp_path_factory.getbasetemp()
    root = base if worker_id == "master" else base.parent  # the run's folder, shared by its test processes
    folder = root / "hf-reference"
    with FileLock(str(root / "hf-reference.lock")):
        if not folder.exists():
            gguf = root / "hf-reference.gguf"
            model_only(resolve_model(None)[1], gguf)
            save_hf_target(load_hf_target(str(gguf), device="cpu"), folder)
            gguf.unlink()
    return load_hf_target(str(folder), device="cpu")


@pytest.fixture(scope="session")
def mt_bench_prompts() -> list[str]:
    from mlx_redrafter.prompts import first_turns

    return [r["prompt"] for r in first_turns()]


@pytest.fixture(scope="session")
def chat_ids(target, mt_bench_prompts):
    """Chat-formatted token ids of the MT-bench first turns."""
    return [target.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in mt_bench_prompts]
