"""Auto-tune: `tune` stores a decision per machine/model/drafter, and generate/chat honour it (real model)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from mlx_redrafter import tuning
from mlx_redrafter.cli import app

PROMPT = "Name three primary colors."


@pytest.fixture()
def tuned_file(tmp_path, monkeypatch):
    path = tmp_path / "tuned.json"
    monkeypatch.setenv("REDRAFTER_TUNED_FILE", str(path))
    return path


def _generate(*flags: str) -> dict:
    res = CliRunner().invoke(app, ["generate", "-p", PROMPT, "-n", "6", "--json", "--drafter", "random:0", *flags])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_resolve_order_without_model(tuned_file):
    """Flags beat the tuned entry, the tuned entry beats the built-in default; --no-draft always wins."""
    assert tuning.resolve(None, "random:0", None, None, "auto", False).source == "default"
    d = tuning.resolve(None, "random:0", None, None, "auto", False)
    assert (d.beam_width, d.beam_length, d.no_draft) == (tuning.DEFAULT_BEAM_WIDTH, tuning.DEFAULT_BEAM_LENGTH, False)
    tuning.store(None, "random:0", {"decision": "redrafter", "beam_width": 2, "beam_length": 3, "dtype": "float32"})
    d = tuning.resolve(None, "random:0", None, None, "auto", False)
    assert (d.beam_width, d.beam_length, d.dtype, d.source) == (2, 3, "float32", "tuned")
    d = tuning.resolve(None, "random:0", 3, None, "auto", False)
    assert (d.beam_width, d.beam_length, d.source) == (3, tuning.DEFAULT_BEAM_LENGTH, "flags")
    assert tuning.resolve(None, "random:0", None, None, "auto", True).no_draft
    assert tuning.resolve(None, "random:1", None, None, "auto", False).source == "default"  # other drafter
    assert tuning.resolve(None, "none", None, None, "auto", False).source == "default"


def test_corrupt_tuned_file_is_one_line_error(tuned_file):
    tuned_file.write_text("{not json")
    res = CliRunner().invoke(app, ["generate", "-p", PROMPT, "--drafter", "random:0"])
    assert res.exit_code == 2
    assert "tuned settings file" in res.output and "Traceback" not in res.output


def test_tune_then_generate_uses_decision(tuned_file):
    """A tune that no cell can win (min speedup 1000x) stores AR; generate then decodes AR; a stored cell is used."""
    res = CliRunner().invoke(app, ["tune", "--drafter", "random:0", "--widths", "1", "--lengths", "2",
                                   "--num-prompts", "1", "--max-tokens", "4", "--min-speedup", "1000"])
    assert res.exit_code == 0, res.output
    entries = json.loads(tuned_file.read_text())["entries"]
    assert len(entries) == 1
    (key, entry), = entries.items()
    assert key.endswith("|smollm2-135m|random:0")
    assert entry["decision"] == "ar" and entry["dtype"] == "float32"
    assert [(c["beam_width"], c["beam_length"]) for c in entry["cells"]] == [(1, 2)]

    out = _generate()
    assert (out["drafter"], out["beam_width"], out["settings_source"]) == ("none", 0, "tuned")
    ar_tokens = out["tokens"]

    tuning.store(None, "random:0", {"decision": "redrafter", "beam_width": 2, "beam_length": 3, "dtype": "float32"})
    out = _generate()
    got = (out["drafter"], out["beam_width"], out["beam_length"], out["settings_source"])
    assert got == ("random:0", 2, 3, "tuned")
    assert out["steps"] > 0 and out["candidate_tokens"] == 6 * out["steps"]
    assert out["tokens"] == ar_tokens  # greedy fp32: speculative output equals AR

    out = _generate("-w", "1", "-l", "2")  # explicit flags win over the tuned cell
    assert (out["beam_width"], out["beam_length"], out["settings_source"]) == (1, 2, "flags")


def _cell(dtype: str, method: str, w: int, L: int, tps: float, speedup: float, tok_s: float) -> dict:
    return {"dtype": dtype, "method": method, "beam_width": w, "beam_length": L, "tokens_per_step": tps,
            "speedup_vs_ar": speedup, "decode_tokens_per_s": tok_s, "match_ar": 1.0}


def test_decide_rules():
    """Needs > MIN_TOKENS_PER_STEP and >= min_speedup to pick a cell; across dtypes the fastest wins."""
    from bench.tune import decide

    ar = _cell("float32", "ar", 0, 0, 1.0, 1.0, 10.0)
    noise = _cell("float32", "redrafter", 1, 2, 1.0, 1.2, 12.0)  # no token gained per call: timing noise
    assert decide([ar, noise], 1.03)["decision"] == "ar"
    good = _cell("float32", "redrafter", 2, 4, 2.1, 1.5, 15.0)
    assert (decide([ar, noise, good], 1.03)["beam_width"], decide([ar, noise, good], 1.03)["beam_length"]) == (2, 4)
    assert decide([ar, good], 1.6)["decision"] == "ar"
    fp16_ar = _cell("float16", "ar", 0, 0, 1.0, 1.0, 20.0)
    fp16 = _cell("float16", "redrafter", 1, 3, 1.8, 1.04, 20.8)
    got = decide([ar, good, fp16_ar, fp16], 1.03)
    assert (got["decision"], got["dtype"], got["beam_width"]) == ("redrafter", "float16", 1)
