"""Checkpoint converter: PyTorch (Apple format, several key spellings) <-> MLX drafters, and its errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from forkserver import run_module  # noqa: E402

from bench.torch_ref.drafter import beam_search as torch_beam_search  # noqa: E402
from bench.torch_ref.drafter import random_torch_drafter  # noqa: E402
from convert import from_torch, to_torch  # noqa: E402
from mlx_redrafter.cache import KVCache  # noqa: E402
from mlx_redrafter.draft.beam_search import beam_search  # noqa: E402
from mlx_redrafter.draft.redrafter import (  # noqa: E402
    Drafter,
    DrafterArgs,
    load_drafter,
    quantize_drafter,
    random_drafter,
    save_drafter,
)

ROOT = Path(__file__).resolve().parents[1]
H, V = 576, 49152


@pytest.fixture(scope="module")
def tdrafter():
    """A random PyTorch drafter with Apple's module names (input_proj, since exit_dim != 2H)."""
    return random_torch_drafter(H, V, exit_dim=192, seed=3, scale=4.0)


def apple_config(d) -> dict:
    return {"model_type": "recurrent_drafting_drafter", "vocab_size": V, "hidden_size": H, "exit_dim": 192,
            "num_draft_layers": 2, "num_lookback_tokens": 1, "rnn": True, "architectures": ["Drafter"],
            "torch_dtype": "float32", "transformers_version": "4.44.0"}


def state(d) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().contiguous() for k, v in d.state_dict().items()}


def run_cli(module: str, *args: str) -> subprocess.CompletedProcess:
    return run_module([sys.executable, "-m", module, *args], dict(os.environ), str(ROOT), 300)


def assert_one_line_error(rc: int, err: str, out_dir: Path) -> None:
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert rc != 0
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert not out_dir.exists()
    assert not [p for p in out_dir.parent.iterdir() if p.name.startswith(f".{out_dir.name}")], "temp dir left behind"


def convert(capsys, *args: str) -> tuple[int, str, str]:
    rc = from_torch.main([str(a) for a in args])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


@pytest.fixture(scope="module")
def context(target, chat_ids):
    """Post-norm hidden state and first token of the real target after a real MT-bench prompt."""
    ids = chat_ids[0]
    logits, hidden = target.model(mx.array([ids]), KVCache(len(target.model.model.layers), len(ids)), last_only=True)
    return hidden[:, -1], mx.argmax(logits[:, -1], axis=-1)


def compare_beams(target, context, mlx_drafter, tdrafter, width: int = 4, length: int = 5) -> None:
    h, g0 = context
    beams, lp = beam_search(mlx_drafter, target.model.embed, h, g0, width, length)
    emb = torch.nn.Embedding.from_pretrained(torch.from_numpy(np.array(target.model.model.embed_tokens.weight)))
    t_beams, t_lp = torch_beam_search(tdrafter, emb, torch.from_numpy(np.array(h)), torch.from_numpy(np.array(g0)),
                                      width, length)
    assert np.array_equal(np.array(beams), t_beams.numpy())
    assert np.max(np.abs(np.array(lp) - t_lp.numpy())) <= 1e-4


def test_safetensors_with_config(tmp_path, capsys, target, context, tdrafter):
    from safetensors.torch import save_file

    src = tmp_path / "ckpt"
    src.mkdir()
    save_file(state(tdrafter), str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps(apple_config(tdrafter)))
    out = tmp_path / "mlx"
    rc, stdout, err = convert(capsys, src, "--out", out, "--model", "default")
    assert rc == 0, err
    assert "target check: ok" in stdout and "parameters:" in stdout
    d = load_drafter(out)
    assert d.args.exit_dim == 192 and d.args.rnn and "torch_dtype" not in json.loads((out / "config.json").read_text())
    compare_beams(target, context, d, tdrafter)


@pytest.mark.parametrize("spelling", ["lm_heads", "zero", "no_linear"])
def test_bin_and_pt_spellings_without_config(tmp_path, capsys, target, context, tdrafter, spelling):
    sd = state(tdrafter)
    renamed = {}
    for k, v in sd.items():
        if spelling == "lm_heads":
            k = k.replace("lm_head.", "lm_heads.").replace("input_proj.", "input_projs.")
        elif spelling == "zero":
            k = k.replace("lm_head.", "0.")
        else:
            k = k.replace(".linear.", ".")
        renamed[k] = v
    name = "pytorch_model.bin" if spelling != "zero" else "model.pt"
    f = tmp_path / name
    torch.save(renamed, f)
    out = tmp_path / "mlx"
    rc, stdout, err = convert(capsys, f, "--out", out)
    assert rc == 0, err
    assert "inferred" in stdout and "hidden_size" in stdout
    d = load_drafter(out)
    assert (d.args.hidden_size, d.args.exit_dim, d.args.num_draft_layers, d.args.vocab_size, d.args.rnn) == (
        H, 192, 2, V, True)
    from mlx.utils import tree_flatten

    for k, v in tree_flatten(d.parameters()):
        assert np.array_equal(np.array(v), sd[k].numpy()), k
    compare_beams(target, context, d, tdrafter)


def test_mlx_to_torch_to_mlx_is_identical(tmp_path, capsys):
    from mlx.utils import tree_flatten
    from safetensors.torch import load_file

    d = random_drafter(H, 4096, seed=5, exit_dim=128)  # vocab 4096 keeps the test light; shapes don't matter here
    src = save_drafter(d, tmp_path / "ours")
    assert to_torch.main([str(src), "--out", str(tmp_path / "apple")]) == 0
    sd = load_file(str(tmp_path / "apple" / "model.safetensors"))  # torch-loadable, Apple's key names
    assert "lm_head.2.weight" in sd and "lm_head.0.linear.weight" in sd and "input_proj.weight" in sd
    rc, _, err = convert(capsys, tmp_path / "apple", "--out", tmp_path / "back")
    assert rc == 0, err
    back = load_drafter(tmp_path / "back")
    a, b = dict(tree_flatten(d.parameters())), dict(tree_flatten(back.parameters()))
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(np.array(a[k]), np.array(b[k])), k
    assert back.args.to_dict() == d.args.to_dict()


def test_draft_vocab_head_is_refused_unless_approximate(tmp_path, capsys):
    args = DrafterArgs(vocab_size=4096, hidden_size=H, exit_dim=64, num_draft_layers=1, rnn=True,
                       draft_vocab_size=256)
    d = Drafter(args)
    d.draft_vocab = mx.arange(0, 4096, 16, dtype=mx.int32)
    mx.eval(d.parameters())
    src = save_drafter(d, tmp_path / "fr")
    out = tmp_path / "apple"
    rc = to_torch.main([str(src), "--out", str(out)])
    assert_one_line_error(rc, capsys.readouterr().err, out)
    assert to_torch.main([str(src), "--out", str(out), "--approximate-draft-vocab"]) == 0
    full = mx.load(str(out / "model.safetensors"))["lm_head.1.weight"]
    assert full.shape == (4096, 64)
    assert np.array_equal(np.array(full[d.draft_vocab]), np.array(d.lm_head[-1].weight))
    assert float(mx.abs(full[1]).max()) == 0.0


def _write_safetensors(tmp_path: Path, sd: dict, cfg: dict | None = None) -> Path:
    from safetensors.torch import save_file

    src = tmp_path / "ckpt"
    src.mkdir(exist_ok=True)
    save_file(sd, str(src / "model.safetensors"))
    if cfg is not None:
        (src / "config.json").write_text(json.dumps(cfg))
    return src


def test_truncated_and_corrupt_safetensors(tmp_path, capsys, tdrafter):
    src = _write_safetensors(tmp_path, state(tdrafter))
    f = src / "model.safetensors"
    data = f.read_bytes()
    out = tmp_path / "out"
    f.write_bytes(data[: len(data) // 2])
    rc, _, err = convert(capsys, f, "--out", out)
    assert_one_line_error(rc, err, out)
    assert "truncated" in err
    f.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all" + data[24:100])
    rc, _, err = convert(capsys, f, "--out", out)
    assert_one_line_error(rc, err, out)


def test_malicious_pickle_is_refused_and_never_runs(tmp_path, tdrafter):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (eval, (f"open({str(marker)!r}, 'w').write('x')",))

    sd = state(tdrafter)
    sd["lm_head.0.linear.bias"] = Evil()
    f = tmp_path / "pytorch_model.bin"
    torch.save(sd, f)
    out = tmp_path / "out"
    r = run_cli("convert.from_torch", str(f), "--out", str(out))
    assert_one_line_error(r.returncode, r.stderr, out)
    assert "refusing" in r.stderr and not marker.exists()


def test_bad_weights_and_mismatches(tmp_path, capsys, tdrafter):
    out = tmp_path / "out"
    cases = []
    sd = state(tdrafter)
    sd["lm_head.1.linear.weight"][0, 0] = float("nan")
    cases.append(("NaN", sd, None, "lm_head.1.linear.weight"))
    sd = state(tdrafter)
    sd["extra_head.weight"] = torch.zeros(3)
    cases.append(("unknown", sd, None, "extra_head.weight"))
    sd = state(tdrafter)
    del sd["rnn_u.bias"]
    cases.append(("missing", sd, None, "rnn_u.bias"))
    cases.append(("shape", state(tdrafter), {**apple_config(tdrafter), "exit_dim": 256}, "input_proj"))
    for name, sd, cfg, needle in cases:
        (tmp_path / name).mkdir()
        src = _write_safetensors(tmp_path / name, sd, cfg)
        rc, _, err = convert(capsys, src, "--out", out)
        assert_one_line_error(rc, err, out)
        assert needle in err, (name, err)


def test_mismatched_vocab_against_model(tmp_path, capsys):
    small = random_torch_drafter(H, 1000, exit_dim=64, seed=1)
    src = _write_safetensors(tmp_path, state(small))
    out = tmp_path / "out"
    rc, _, err = convert(capsys, src, "--out", out, "--model", "default")
    assert_one_line_error(rc, err, out)
    assert "vocab_size 1000" in err and "49152" in err


def test_quantize(tmp_path, capsys, tdrafter):
    """--quantize 4|8 writes a quantized drafter equal to quantizing the float conversion; bad settings fail."""
    src = _write_safetensors(tmp_path, state(tdrafter), apple_config(tdrafter))
    rc, _, err = convert(capsys, src, "--out", tmp_path / "float")
    assert rc == 0, err
    h, s = mx.random.normal((3, H), key=mx.random.key(0)), mx.random.normal((3, H), key=mx.random.key(1))
    for bits in (4, 8):
        out = tmp_path / f"q{bits}"
        rc, stdout, err = convert(capsys, src, "--out", out, "--quantize", bits)
        assert rc == 0, err
        assert f"quantized to {bits} bits (group size 64)" in stdout
        assert json.loads((out / "config.json").read_text())["quantization"] == {"bits": bits, "group_size": 64}
        q = load_drafter(out)
        assert q.args.quantization == {"bits": bits, "group_size": 64}
        ref = quantize_drafter(load_drafter(tmp_path / "float"), bits, 64)
        assert np.array_equal(np.array(q.logits(h, s)), np.array(ref.logits(h, s)))
        assert q.num_params() == ref.num_params() == load_drafter(tmp_path / "float").num_params()
    out = tmp_path / "bad"
    for args, needle in [(["--quantize", "3"], "bits = 3"), (["--quantize", "4", "--group-size", "48"], "group size"),
                         (["--quantize", "8", "--group-size", "128"], "exit_dim 192")]:
        rc, _, err = convert(capsys, src, "--out", out, *args)
        assert_one_line_error(rc, err, out)
        assert needle in err, err
    rc, _, err = convert(capsys, tmp_path / "q4", "--out", out)  # our quantized output is not a torch checkpoint
    assert_one_line_error(rc, err, out)
    assert "quantized MLX drafter" in err


def test_existing_output_needs_force(tmp_path, capsys, tdrafter):
    src = _write_safetensors(tmp_path, state(tdrafter))
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    rc, _, err = convert(capsys, src, "--out", out)
    assert rc == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1 and "--force" in err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    rc, _, err = convert(capsys, src, "--out", out, "--force")  # --force never deletes files a save did not write
    assert rc == 2 and "holds files a drafter save does not write (keep.txt)" in err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    (out / "keep.txt").unlink()
    (out / "config.json").write_text("{}")  # a stale drafter file: --force replaces it
    rc, _, err = convert(capsys, src, "--out", out, "--force", "--quantize", "8")
    assert rc == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert load_drafter(out).args.quantization == {"bits": 8, "group_size": 64}


def test_to_torch_refuses_quantized_unless_dequantize(tmp_path, capsys):
    d = quantize_drafter(random_drafter(H, 4096, seed=5, exit_dim=128), 4, 64)
    src = save_drafter(d, tmp_path / "q4")
    out = tmp_path / "apple"
    rc = to_torch.main([str(src), "--out", str(out)])
    err = capsys.readouterr().err
    assert_one_line_error(rc, err, out)
    assert "--dequantize" in err and "4 bits" in err
    assert to_torch.main([str(src), "--out", str(out), "--dequantize"]) == 0
    assert "dequantized from 4 bits" in capsys.readouterr().out
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization" not in cfg
    assert all(v.dtype == mx.float32 for v in mx.load(str(out / "model.safetensors")).values())
    rc, _, err = convert(capsys, out, "--out", tmp_path / "back")  # and back: a float drafter, same function
    assert rc == 0, err
    back = load_drafter(tmp_path / "back")
    h, s = mx.random.normal((2, H), key=mx.random.key(2)), mx.random.normal((2, H), key=mx.random.key(3))
    assert back.args.quantization is None
    assert np.allclose(np.array(back.logits(h, s)), np.array(d.logits(h, s)), atol=1e-4)


@pytest.mark.parametrize("module,args,needle", [
    ("from_torch", [], "Missing argument"),
    ("from_torch", ["x", "--bogus"], "No such option"),
    ("from_torch", ["x", "--quantize", "four"], "--quantize"),
    ("from_torch", ["x", "--dtype", "float64"], "float64"),
    ("to_torch", ["x"], "Missing option '--out'"),
    ("to_torch", ["x", "--out", "y", "--dtype", "int8"], "int8"),
])
def test_usage_errors_are_one_line(tmp_path, capsys, module, args, needle):
    rc = {"from_torch": from_torch, "to_torch": to_torch}[module].main(args)
    err = capsys.readouterr().err
    assert_one_line_error(rc, err, tmp_path / "never")
    assert rc == 2 and needle in err, err


def test_help_runs_as_a_module():
    for module in ("convert.from_torch", "convert.to_torch"):
        r = run_cli(module, "--help")
        assert r.returncode == 0 and "--out" in r.stdout and "--force" in r.stdout, r.stderr


def test_a_drafter_that_fuses_target_layers_imports_with_its_config(tmp_path, capsys):
    """What the CUDA job trains (Apple's names plus `fuse.weight`, `feature_layers` in config.json) imports as the
    same drafter; without a config naming the layers it is a one-line error, not a guess."""
    from mlx.utils import tree_flatten
    from safetensors.numpy import save_file

    d = random_drafter(H, 4096, seed=6, exit_dim=128, feature_layers=[2, 15, 24])
    flat = {k: np.array(v) for k, v in tree_flatten(d.parameters())}
    assert flat["fuse.weight"].shape == (H, 4 * H)
    (tmp_path / "job").mkdir()
    save_file(flat, str(tmp_path / "job" / "model.safetensors"))
    (tmp_path / "job" / "config.json").write_text(json.dumps(d.args.to_dict()))
    rc, _, err = convert(capsys, tmp_path / "job", "--out", tmp_path / "back")
    assert rc == 0, err
    back = load_drafter(tmp_path / "back")
    assert back.args.feature_layers == [2, 15, 24]
    b = dict(tree_flatten(back.parameters()))
    assert sorted(b) == sorted(flat) and all(np.array_equal(np.array(b[k]), flat[k]) for k in flat)
    (tmp_path / "job" / "config.json").unlink()
    rc, _, err = convert(capsys, tmp_path / "job" / "model.safetensors", "--out", tmp_path / "guess",
                         "--model", "smollm2-135m")
    assert_one_line_error(rc, err, tmp_path / "guess")
    assert "fuse.weight" in err and "feature_layers" in err
