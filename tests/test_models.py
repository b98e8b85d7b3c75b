"""Model resolution: registry names, local paths, the Hugging Face cache, and fast one-line errors offline."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mlx_redrafter.errors import UserError
from mlx_redrafter.models import hub, registry
from mlx_redrafter.models.loader import ALIASES, resolve_model

CLI = str(Path(sys.executable).parent / "redrafter-mlx")
REQUIRED = ("smollm2-135m", "vicuna-7b", "vicuna-7b-4bit", "vicuna-13b-4bit", "llama-3.2-1b-4bit",
            "llama-3-8b-instruct-4bit")
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def empty_hf_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache, offline (HF_HUB_OFFLINE), for in-process resolution."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return tmp_path / "hub"


def test_registry_has_the_zoo():
    for name in REQUIRED:
        e = registry.get(name)
        assert e is not None and e.name == name
        assert name == "smollm2-135m" or e.repo.count("/") == 1
    assert registry.get("smollm2-135m").drafter == "smollm2-135m"
    assert all(registry.get(n).template == "vicuna" and registry.get(n).tokenizer == "sentencepiece"
               for n in ("vicuna-7b", "vicuna-7b-4bit", "vicuna-13b-4bit"))
    assert ALIASES["vicuna-7b-4bit"].startswith("TheBloke/vicuna-7B-v1.5-GGUF/")
    assert "vicuna-13b-4bit" in registry.describe()


def test_local_paths_and_the_default_resolve_without_network(target):
    assert resolve_model(None) == ("smollm2-135m", target.path)
    assert resolve_model(str(target.path)) == (target.path.name, target.path)
    with pytest.raises(UserError, match="does not exist"):
        resolve_model("./missing/model.gguf")
    with pytest.raises(UserError, match="unknown model .* smollm2-135m, smollm2-135m-mlx, vicuna-7b"):
        resolve_model("no-such-model")


@pytest.mark.parametrize("name,needles", [
    ("vicuna-7b-4bit", ["TheBloke/vicuna-7B-v1.5-GGUF", "hf download TheBloke/vicuna-7B-v1.5-GGUF "
                                                        "vicuna-7b-v1.5.Q4_0.gguf", "HF_HUB_OFFLINE"]),
    ("llama-3.2-1b-4bit", ["hf download mlx-community/Llama-3.2-1B-Instruct-4bit"]),
    ("acme/some-model", ["hf download acme/some-model"]),
    ("acme/some-model/weights.Q8_0.gguf", ["hf download acme/some-model weights.Q8_0.gguf"]),
])
def test_offline_and_not_cached_is_a_clear_error(empty_hf_cache, name, needles):
    t0 = time.perf_counter()
    with pytest.raises(UserError) as e:
        resolve_model(name)
    assert time.perf_counter() - t0 < 5
    msg = str(e.value)
    assert "\n" not in msg and "--model" in msg
    for n in needles:
        assert n in msg


def cached_snapshot(cache: Path, files: dict[str, bytes]) -> Path:
    """A snapshot of acme/tiny-llama in a Hugging Face cache, holding `files`."""
    repo = cache / "models--acme--tiny-llama"
    snap = repo / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    for name, data in files.items():
        (snap / name).write_bytes(data)
    return snap


def tiny_safetensors() -> bytes:
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    return len(header).to_bytes(8, "little") + header + bytes(8)


COMPLETE = {"config.json": json.dumps({"model_type": "llama"}).encode(), "tokenizer.json": b"{}",
            "model.safetensors": tiny_safetensors()}


def test_a_cached_repo_is_used_without_the_network(empty_hf_cache, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub, "_unreachable", lambda endpoint: pytest.fail("the network was used"))
    snap = cached_snapshot(empty_hf_cache, COMPLETE)
    assert resolve_model("acme/tiny-llama") == ("acme/tiny-llama", snap)


@pytest.mark.parametrize("drop,missing", [
    ("model.safetensors", "model.safetensors"),  # interrupted before the weights
    ("tokenizer.json", "tokenizer.json"),
    ("cut", "model.safetensors"),  # a weights file cut short
    ("shard", "model-00002-of-00002.safetensors"),  # one shard of two
])
def test_a_partial_snapshot_is_resumed_not_taken_as_complete(empty_hf_cache, monkeypatch, drop, missing):
    from huggingface_hub import constants

    files = dict(COMPLETE)
    if drop == "cut":
        files["model.safetensors"] = files["model.safetensors"][:-4]
    elif drop == "shard":
        del files["model.safetensors"]
        files["model-00001-of-00002.safetensors"] = tiny_safetensors()
        files["model.safetensors.index.json"] = json.dumps({"weight_map": {
            "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}).encode()
    else:
        del files[drop]
    snap = cached_snapshot(empty_hf_cache, files)
    assert hub.missing_files(snap) == [missing] and hub.cached("acme/tiny-llama") is None
    with pytest.raises(UserError, match=f"only partly in the Hugging Face cache \\(missing: {missing}.*resume"):
        resolve_model("acme/tiny-llama")  # offline: says so in one line
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub, "_unreachable", lambda endpoint: None)
    resumed = []
    monkeypatch.setattr(hub, "_download", lambda repo, filename, local_only: (
        snap if local_only else resumed.append(repo) or snap))
    resolve_model("acme/tiny-llama")  # online: the download runs again (huggingface-hub fetches what is missing)
    assert resumed == ["acme/tiny-llama"]


def test_unreachable_hub_fails_fast_with_one_line(tmp_path):
    """A hub that accepts connections but never answers (a black hole): the CLI gives up within seconds."""
    with socket.socket() as sink:
        sink.bind(("127.0.0.1", 0))
        sink.listen(8)
        env = dict(os.environ, HF_HOME=str(tmp_path), HF_ENDPOINT=f"http://127.0.0.1:{sink.getsockname()[1]}",
                   MKL_NUM_THREADS="1", REDRAFTER_TUNED_FILE=str(tmp_path / "none.json"), REDRAFTER_HUB_TIMEOUT="3")
        env.pop("HF_HUB_OFFLINE", None)
        t0 = time.perf_counter()
        proc = subprocess.run([CLI, "generate", "-p", "hi", "--model", "vicuna-7b-4bit"], capture_output=True,
                              text=True, env=env, stdin=subprocess.DEVNULL, timeout=60)
        elapsed = time.perf_counter() - t0
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: cannot download vicuna-7b-4bit"), proc.stderr
    assert "unreachable" in lines[0] and "hf download TheBloke/vicuna-7B-v1.5-GGUF" in lines[0]
    assert elapsed < 20
