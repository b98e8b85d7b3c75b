"""Malformed drafters, converter inputs, tuned settings, prompts files and token ids through the real CLI (and the
API for ids): one `error:` line, exit status 2, no traceback, no native crash, no hang."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from one_line import CLI, assert_one_line_error, generate, run

from mlx_redrafter.draft.redrafter import random_drafter, save_drafter
from mlx_redrafter.errors import UserError

H, V = 576, 49152  # the embedded default model


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory):
    """A valid small drafter for the default model (a 64-token draft vocabulary)."""
    d = random_drafter(H, V, seed=0, exit_dim=64, num_draft_layers=1, draft_vocab_size=64)
    return save_drafter(d, tmp_path_factory.mktemp("drafters") / "ok")


def variant(src, dst, config=None, weights=None, raw_config=None):
    """A copy of a drafter directory with its config.json edited (a dict of changes, None values removed; or raw
    bytes) and/or its weights replaced (a dict of arrays, or raw bytes)."""
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    if config is not None:
        cfg = {k: v for k, v in {**cfg, **config}.items() if v is not None}
    (dst / "config.json").write_bytes(raw_config if raw_config is not None else json.dumps(cfg).encode())
    if isinstance(weights, dict):
        tensors = dict(mx.load(str(src / "model.safetensors")))
        tensors.update(weights)
        mx.save_safetensors(str(dst / "model.safetensors"), tensors)
    else:
        (dst / "model.safetensors").write_bytes(weights if weights is not None else
                                                (src / "model.safetensors").read_bytes())
    return dst


DRAFTER_CASES = {
    "config not an object": (dict(raw_config=b"[1, 2, 3]"), ["JSON array"]),
    "config not JSON": (dict(raw_config=b'{"vocab_size": 49152,'), ["not valid JSON"]),
    "config not UTF-8": (dict(raw_config=b'{"vocab_size": 49152, "x": "\xff"}'), ["not UTF-8"]),
    "missing key": (dict(config={"exit_dim": None}), ["lacks exit_dim"]),
    "a string for an int": (dict(config={"hidden_size": "576"}), ["hidden_size = '576'"]),
    "layers as 1e8": (dict(config={"num_draft_layers": 1e8}), ["num_draft_layers = 100000000.0"]),
    "a hundred million layers": (dict(config={"num_draft_layers": 10**8}), ["num_draft_layers = 100000000",
                                                                              "from 0 to 64"]),
    "absurd vocabulary": (dict(config={"vocab_size": 10**12}), ["vocab_size"]),
    "negative width": (dict(config={"exit_dim": -64}), ["exit_dim = -64"]),
    "a string for a bool": (dict(config={"rnn": "yes"}), ["rnn = 'yes'"]),
    "draft vocabulary larger than the vocabulary": (dict(config={"draft_vocab_size": V + 1}),
                                                    ["draft_vocab_size"]),
    "unknown model type": (dict(config={"model_type": "gpt"}), ["unknown drafter model_type 'gpt'"]),
    "unsupported quantization": (dict(config={"quantization": {"bits": 3, "group_size": 64}}), ["bits = 3"]),
    "draft vocabulary id past the vocabulary": (
        dict(weights={"draft_vocab": mx.arange(V - 60, V + 4, dtype=mx.int32)}), ["token id 49155", "[0, 49152)"]),
    "negative draft vocabulary id": (dict(weights={"draft_vocab": mx.arange(-1, 63, dtype=mx.int32)}),
                                     ["token id -1"]),
    "draft vocabulary of floats": (dict(weights={"draft_vocab": mx.arange(64).astype(mx.float32)}),
                                   ["1-D integer array"]),
    "weights cut short": ("cut", ["truncated", "re-download"]),
    "weights header not JSON": (dict(weights=struct.pack("<Q", 5) + b"{oops"), ["not valid JSON"]),
    "weights of another shape": (dict(weights={"lm_head.1.weight": mx.zeros((64, 32))}),
                                 ["do not match its config.json"]),
    "Medusa heads as a string": (dict(raw_config=json.dumps({"model_type": "medusa", "vocab_size": V, "hidden_size": H,
                                                             "medusa_num_heads": "3"}).encode()),
                                 ["medusa_num_heads = '3'"]),
    "a billion Medusa heads": (dict(raw_config=json.dumps({"model_type": "medusa", "vocab_size": V, "hidden_size": H,
                                                           "medusa_num_heads": 10**9}).encode()),
                               ["medusa_num_heads = 1000000000"]),
    "negative Medusa layers": (dict(raw_config=json.dumps({"model_type": "medusa", "vocab_size": V, "hidden_size": H,
                                                           "medusa_num_heads": 2, "medusa_num_layers": -1}).encode()),
                               ["medusa_num_layers = -1"]),
    "unknown semi-AR TLM": (dict(raw_config=json.dumps({"model_type": "semi_ar_drafter", "vocab_size": V,
                                                        "hidden_size": H, "tlm": "gru", "tlm_dim": 8,
                                                        "exit_dim": 8}).encode()), ["tlm = 'gru'"]),
    "semi-AR width zero": (dict(raw_config=json.dumps({"model_type": "semi_ar_drafter", "vocab_size": V,
                                                       "hidden_size": H, "tlm": "lstm", "tlm_dim": 0,
                                                       "exit_dim": 8}).encode()), ["tlm_dim = 0"]),
}


@pytest.mark.parametrize("case", list(DRAFTER_CASES))
def test_malformed_drafter(tmp_path, drafter_dir, case):
    edits, needles = DRAFTER_CASES[case]
    if edits == "cut":
        data = (drafter_dir / "model.safetensors").read_bytes()
        edits = dict(weights=data[: len(data) - 100])
    d = variant(drafter_dir, tmp_path / "d", **edits)
    assert_one_line_error(generate(tmp_path, "--drafter", str(d), "--draft", "rnn"), *needles)


def test_the_valid_drafter_generates(tmp_path, drafter_dir):
    proc = generate(tmp_path, "--drafter", str(drafter_dir), "--draft", "rnn", "--json")
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)["tokens"]) == 4


@pytest.mark.parametrize("width", ["-5", "0", "100000"])
def test_random_drafter_spec_with_a_bad_width(tmp_path, width):
    """0 used to mean the default silently; 100000 built a 100000-wide drafter (a native crash or out of memory)."""
    assert_one_line_error(generate(tmp_path, "--drafter", f"random:0:{width}", "--draft", "rnn"),
                          f"exit_dim = {width}", "from 1 to 4,608")


@pytest.mark.parametrize("layers,needles", [(1e8, ["100000000.0", "not an integer"]),
                                             (10**8, ["num_draft_layers = 100000000", "from 0 to 64"])])
def test_converter_refuses_absurd_sizes_at_once(tmp_path, layers, needles):
    """num_draft_layers = 1e8 used to build a hundred million modules (a hang): now one line."""
    src = tmp_path / "ckpt"
    src.mkdir()
    d = random_drafter(H, V, seed=1, exit_dim=64, num_draft_layers=1)
    mx.save_safetensors(str(src / "model.safetensors"),
                        {k: v for k, v in tree_flatten(d.parameters())})
    (src / "config.json").write_text(json.dumps({**d.args.to_dict(), "num_draft_layers": layers}))
    proc = run([sys.executable, "-m", "convert.from_torch", str(src), "--out", str(tmp_path / "out")], tmp_path)
    assert_one_line_error(proc, *needles)
    assert not (tmp_path / "out").exists()


def test_converter_refuses_out_of_range_draft_vocab(tmp_path):
    src = tmp_path / "ckpt"
    src.mkdir()
    d = random_drafter(H, V, seed=1, exit_dim=64, num_draft_layers=1, draft_vocab_size=64)
    tensors = dict(tree_flatten(d.parameters()))
    tensors["draft_vocab"] = mx.arange(V, V + 64, dtype=mx.int32)
    mx.save_safetensors(str(src / "model.safetensors"), tensors)
    (src / "config.json").write_text(json.dumps(d.args.to_dict()))
    proc = run([sys.executable, "-m", "convert.from_torch", str(src), "--out", str(tmp_path / "out")], tmp_path)
    assert_one_line_error(proc, "draft_vocab", f"outside the vocabulary [0, {V})")


# --- tuned settings, prompts files ------------------------------------------------------------------------------

def tuned(entry) -> bytes:
    return json.dumps({"version": 2, "entries": {"machine|model|drafter": entry}}).encode()


TUNED_CASES = {
    "not UTF-8": (b'{"version": 2, "entries": {"\xff": 1}}', ["not UTF-8", "re-run"]),
    "not JSON": (b"{version: 2}", ["not valid JSON"]),
    "not an object": (b"[2]", ["JSON array"]),
    "entries not an object": (json.dumps({"version": 2, "entries": [1]}).encode(), ["unexpected layout"]),
    "entry not an object": (tuned("lookup"), ["'machine|model|drafter'", "JSON string"]),
    "a string for a width": (tuned({"draft": "lookup", "beam_width": "2"}), ["beam_width = '2'"]),
    "a float for a length": (tuned({"draft": "lookup", "beam_length": 4.5}), ["beam_length = 4.5"]),
    "unknown draft mode": (tuned({"draft": "fast"}), ["draft = 'fast'"]),
    "unknown dtype": (tuned({"draft": "none", "dtype": "float8"}), ["dtype = 'float8'"]),
    "a length past the options' range": (tuned({"draft": "lookup", "beam_length": 1000}),
                                         ["not a flag you gave", "--beam-length must be an integer from 2 to 64",
                                          "got 1000", "re-run"]),
    "a lookup width past the options' range": (tuned({"draft": "lookup", "lookup_width": 65}),
                                               ["not a flag you gave", "--lookup-width", "got 65"]),
}


@pytest.mark.parametrize("case", list(TUNED_CASES))
def test_malformed_tuned_settings(tmp_path, case):
    data, needles = TUNED_CASES[case]
    f = tmp_path / "tuned.json"
    f.write_bytes(data)
    msg = assert_one_line_error(generate(tmp_path, REDRAFTER_TUNED_FILE=str(f)), *needles)
    assert "tuned settings file" in msg


def test_a_tuned_mode_the_drafter_cannot_serve_names_the_tuned_file(tmp_path, monkeypatch):
    """The mode came from the tuned file, not from a flag: the message must not blame --draft."""
    from mlx_redrafter import tuning

    f = tmp_path / "tuned.json"
    monkeypatch.setenv("REDRAFTER_TUNED_FILE", str(f))
    tuning.store(None, "default", {"draft": "medusa"})
    msg = assert_one_line_error(generate(tmp_path, REDRAFTER_TUNED_FILE=str(f)), "draft medusa from the tuned "
                                f"settings file {f}", "needs a Medusa drafter")
    assert not msg.startswith("--draft")


PROMPTS_CASES = {
    "a directory": ("dir", ["is a directory"]),
    "not UTF-8": (b'{"prompt": "caf\xe9"}\n', ["not UTF-8", "line 1"]),
    "not JSON": (b'{"prompt": "a"}\n{"prompt": \n', [":2 is not valid JSON"]),
    "no prompt": (b'{"text": "a"}\n', [":1 has no non-empty"]),
    "empty": (b"\n\n", ["has no prompts"]),
    "missing": ("missing", ["does not exist"]),
    "a lone surrogate": (b'{"prompt": "hi \\ud83d there"}\n', ["not valid UTF-8 text", "lone surrogate"]),
}


@pytest.mark.parametrize("case", list(PROMPTS_CASES))
def test_malformed_prompts_file(tmp_path, case):
    data, needles = PROMPTS_CASES[case]
    f = tmp_path / "prompts.jsonl"
    if data == "dir":
        f.mkdir()
    elif data != "missing":
        f.write_bytes(data)
    proc = run([*CLI, "generate", "--prompts-file", str(f), "-n", "2"], tmp_path)
    assert_one_line_error(proc, *needles)


def test_a_prompt_that_is_not_utf8(tmp_path):
    """A command-line byte that is not UTF-8 reaches Python as a lone surrogate (surrogateescape)."""
    proc = run([*CLI, "generate", "-n", "2", "-p", os.fsdecode(b"caf\xe9 \xff")], tmp_path)
    assert_one_line_error(proc, "the prompt is not valid UTF-8 text", "the byte 0xe9")


def test_a_piped_chat_line_that_is_not_utf8_ends_the_chat(tmp_path):
    """Piped input cannot be retyped, so a refused line is bad input of the run: one error line, exit 2, and the
    lines after it are not answered (at a terminal the chat goes on)."""
    from one_line import cli_env

    proc = subprocess.run([*CLI, "chat", "-n", "2"], input=b"caf\xe9 \xff\nhello\n", capture_output=True,
                          timeout=300, env=cli_env(tmp_path), cwd=tmp_path)
    err = proc.stderr.decode()
    assert proc.returncode == 2, err
    assert "Traceback" not in err
    errors = [ln for ln in err.splitlines() if "error:" in ln]
    assert len(errors) == 1 and "not valid UTF-8 text" in errors[0], err
    assert proc.stdout.decode().count(">>>") + err.count(">>>") == 1, (proc.stdout, err)


@pytest.mark.parametrize("body,needle", [
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ("{{ foo.bar }}", "UndefinedError"),
    ("{% for m in messages %}{{ messages[5].content }}{% endfor %}", "failed"),
    ("{% for i in range(10**9) %}x{% endfor %}", "was stopped"),
])
def test_a_chat_template_that_cannot_render_fails_before_the_chat(tmp_path, body, needle):
    """It used to print the error per message and exit 0 at the end of input."""
    f = tmp_path / "t.jinja"
    f.write_text(body)
    proc = run([*CLI, "chat", "-n", "2", "--template", str(f)], tmp_path)
    assert_one_line_error(proc, f"the chat template (--template {f})", needle)


# --- token ids through the API ---------------------------------------------------------------------------------

@pytest.mark.parametrize("ids,needle", [
    ([1, 2, V], f"token id {V} is outside"),
    ([1, -1, 2], "token id -1"),
    ([1, 2.0, 3], "2.0 is not a token id"),
    ([1, "2"], "'2' is not a token id"),
    ([True, 2], "True is not a token id"),
])
def test_prompt_ids_outside_the_vocabulary_are_refused(target, ids, needle):
    """MLX's embedding gather does not check bounds (an id past it read out of bounds)."""
    from mlx_redrafter import api

    lm = api.LoadedModel(target, None, "none")
    with pytest.raises(UserError, match=needle):
        api.generate(lm, ids, max_tokens=2)
    assert api.generate(lm, [1, 2, V - 1], max_tokens=2).tokens  # the edge of the vocabulary is fine
