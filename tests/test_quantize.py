"""`redrafter-mlx quantize`: an mlx-lm compatible 4-bit directory that mlx-lm and our runtime decode alike."""

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from mlx_redrafter.generate import generate_ar
from mlx_redrafter.models import quantize as q
from mlx_redrafter.models.loader import load_target

CLI = str(Path(sys.executable).parent / "redrafter-mlx")
PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """The embedded model (Q4_1 GGUF, dequantized) re-quantized to 4 bits, group 64, float32 scales."""
    out = tmp_path_factory.mktemp("q") / "smollm2-q4"
    proc = subprocess.run([CLI, "quantize", "smollm2-135m", str(out), "--bits", "4", "--group-size", "64",
                           "--dtype", "float32", "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["quantized_modules"] == 211 and summary["requantized"]
    return out


def test_layout_is_mlx_lm_s(quantized):
    cfg = json.loads((quantized / "config.json").read_text())
    assert cfg["quantization"] == {"group_size": 64, "bits": 4, "mode": "affine"}
    assert cfg["quantization_config"] == cfg["quantization"]
    assert cfg["model_type"] == "llama" and cfg["tie_word_embeddings"] is True
    assert {"model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {p.name for p in quantized.iterdir()}
    w = mx.load(str(quantized / "model.safetensors"))
    assert w["model.layers.0.mlp.down_proj.weight"].dtype == mx.uint32
    assert w["model.layers.0.mlp.down_proj.scales"].shape == (576, 1536 // 64)
    assert w["model.norm.weight"].dtype == mx.float32
    assert not [p for p in quantized.parent.iterdir() if p.name.startswith(".")]  # no temp dirs left


def test_mlx_lm_and_our_runtime_give_the_same_greedy_tokens(quantized):
    from mlx_lm import load as mlx_lm_load
    from mlx_lm.generate import generate_step

    model, tokenizer = mlx_lm_load(str(quantized))
    ours = load_target(str(quantized), "float32")  # dequantized at load (the CPU fast path)
    assert ours.tokenizer.encode_chat(PROMPT) == list(tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True))
    ids = tokenizer.encode("The capital of France is")  # short: mlx-lm's 4-bit prefill is slow on a CPU
    assert ids == ours.tokenizer.encode("The capital of France is")
    ref = [int(y) for (y, _), _ in zip(generate_step(mx.array(ids), model, max_tokens=8), range(8))]
    got = [t for r in generate_ar(ours.model, ids, max_tokens=8) for t in r.tokens]
    assert got == ref


def test_bad_input_is_one_line_and_leaves_nothing(tmp_path, quantized):
    cases = [
        (["smollm2-135m", str(tmp_path / "a"), "--bits", "7"], "--bits"),
        (["smollm2-135m", str(tmp_path / "b"), "--group-size", "48"], "--group-size"),
        (["smollm2-135m", str(quantized)], "already exists"),
        (["/no/such/model", str(tmp_path / "c")], "does not exist"),
    ]
    for args, needle in cases:
        proc = subprocess.run([CLI, "quantize", *args], capture_output=True, text=True, timeout=120)
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_failed_write_leaves_no_directory(tmp_path, monkeypatch, target):
    def boom(out_dir, weights):
        (out_dir / "model.safetensors").write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(q, "_save_weights", boom)
    with pytest.raises(OSError, match="disk full"):
        q.quantize(str(target.path), tmp_path / "out")
    assert list(tmp_path.iterdir()) == []
