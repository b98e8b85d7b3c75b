"""Auto-tune: `tune` stores a decision per machine/model/drafter, and generate honours it (real model)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from mlx_redrafter import tuning
from mlx_redrafter.cmd.app import app
from mlx_redrafter.defaults import DEFAULT_BEAM_LENGTH, DEFAULT_BEAM_WIDTH
from mlx_redrafter.sweep import decide

PROMPT = "Name three primary colors."
NO_FLAGS = {"draft": None, "beam_width": None, "beam_length": None, "lookup_width": None}


@pytest.fixture()
def tuned_file(tmp_path, monkeypatch):
    path = tmp_path / "tuned.json"
    monkeypatch.setenv("REDRAFTER_TUNED_FILE", str(path))
    return path


def _generate(*flags: str) -> dict:
    res = CliRunner().invoke(app, ["generate", "-p", PROMPT, "-n", "6", "--json", "--drafter", "random:0", *flags])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_resolve_order(tuned_file):
    """Field by field: a flag beats the tuned entry, the tuned entry beats the built-in default; entries are per
    drafter; a drafting flag where the entry says plain AR drafts (auto) and says so."""
    d = tuning.resolve(None, "random:0", NO_FLAGS, "auto")
    assert d.source == "default"
    assert (d.options.shape.width, d.options.shape.length) == (DEFAULT_BEAM_WIDTH, DEFAULT_BEAM_LENGTH)
    tuning.store(None, "random:0", {"decision": "speculative", "draft": "rnn", "beam_width": 2, "beam_length": 4,
                                    "dtype": "float32"})
    d = tuning.resolve(None, "random:0", NO_FLAGS, "auto")
    assert (d.options.draft, d.options.shape.width, d.options.shape.length, d.dtype, d.source) == (
        "rnn", 2, 4, "float32", "tuned")
    d = tuning.resolve(None, "random:0", {**NO_FLAGS, "beam_width": 3}, "auto")
    assert (d.options.draft, d.options.shape.width, d.options.shape.length) == ("rnn", 3, 4)  # the rest stays tuned
    assert d.origin == {"draft": "tuned", "beam_width": "flag", "beam_length": "tuned"} and not d.notes
    assert tuning.resolve(None, "random:0", {**NO_FLAGS, "draft": "none"}, "auto").options.draft == "none"
    tuning.store(None, "random:0", {"decision": "ar", "draft": "none", "dtype": "float32"})
    d = tuning.resolve(None, "random:0", {**NO_FLAGS, "beam_width": 2}, "auto")
    assert d.options.draft == "auto" and d.options.shape.width == 2 and "plain decoding" in d.notes[0]
    assert tuning.resolve(None, "random:1", NO_FLAGS, "auto").source == "default"  # another drafter
    assert tuning.resolve(None, "none", NO_FLAGS, "auto").source == "default"


def test_corrupt_tuned_file_is_one_line_error(tuned_file):
    tuned_file.write_text("{not json")
    for args in (["generate", "-p", PROMPT, "--drafter", "random:0"], ["tune", "--drafter", "random:0", "--force"]):
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 2, res.output
        lines = [ln for ln in res.output.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: tuned settings file"), res.output


def test_bad_tune_arguments_are_one_line_errors(tuned_file):
    for args, needle in ((["--widths", "a"], "--widths"), (["--drafts", "bogus"], "--drafts"),
                         (["--max-tokens", "1"], "--max-tokens")):
        res = CliRunner().invoke(app, ["tune", "--drafter", "random:0", "--force", *args])
        assert res.exit_code == 2 and res.output.startswith("error: ") and needle in res.output, res.output
    assert not tuned_file.exists()


def test_tune_then_generate_uses_decision(tuned_file):
    """An impossible --min-speedup stores AR and generate decodes AR; a stored cell is used; flags win."""
    res = CliRunner().invoke(app, ["tune", "--drafter", "random:0", "--drafts", "rnn", "--widths", "1",
                                   "--lengths", "2", "--num-prompts", "1", "--max-tokens", "4", "--min-speedup",
                                   "1000", "--force"])
    assert res.exit_code == 0, res.output
    (key, entry), = json.loads(tuned_file.read_text())["entries"].items()
    assert key.endswith("|smollm2-135m|random:0")
    assert (entry["decision"], entry["draft"], entry["dtype"]) == ("ar", "none", "float32")
    assert [c["config"] for c in entry["cells"]] == ["ar", "rnn-w1-l2"]
    assert isinstance(entry["machine_state"]["quiet"], bool)

    out = _generate()
    assert (out["draft"], out["drafter"], out["beam_width"], out["settings_source"]) == ("none", "none", 0, "tuned")
    ar_tokens = out["tokens"]

    tuning.store(None, "random:0", {"decision": "speculative", "draft": "rnn", "beam_width": 2, "beam_length": 3,
                                    "dtype": "float32"})
    out = _generate()
    assert (out["draft"], out["drafter"], out["beam_width"], out["beam_length"], out["settings_source"]) == (
        "rnn", "random:0", 2, 3, "tuned")
    assert out["steps"] > 0 and out["tokens"] == ar_tokens  # greedy fp32: speculative output equals AR

    out = _generate("-w", "1", "-l", "2")  # explicit flags win over the tuned entry, field by field
    assert (out["draft"], out["beam_width"], out["beam_length"]) == ("rnn", 1, 2)
    assert out["settings_origin"] == {"draft": "tuned", "beam_width": "flag", "beam_length": "flag"}


def _cell(config: str, draft: str, tps: float, speedup: float, tok_s: float, dtype: str = "float32") -> dict:
    return {"config": config, "decoder": "ours", "draft": draft, "dtype": dtype, "temperature": 0.0,
            "beam_width": 2 if "rnn" in draft else 0, "beam_length": 0 if draft == "none" else 4,
            "lookup_width": 1 if "lookup" in draft else 0, "tokens_per_step": tps, "speedup_vs_ar": speedup,
            "decode_tokens_per_s": tok_s, "ar_decode_tokens_per_s": tok_s / speedup, "equal_ar": 1.0,
            "source_tokens_per_step": {}}


def test_decide_rules():
    """A cell needs >= 1.1 tokens per call and >= min_speedup; across dtypes the fastest wins; unused widths
    are not stored."""
    ar = _cell("ar", "none", 1.0, 1.0, 10.0)
    noise = _cell("rnn-w2-l4", "rnn", 1.0, 1.2, 12.0)  # no token gained per call: timing noise
    assert decide([ar, noise], 1.03)["decision"] == "ar"
    good = _cell("lookup-w1-l4", "lookup", 2.1, 1.5, 15.0)
    got = decide([ar, noise, good], 1.03)
    assert (got["decision"], got["draft"], got["beam_length"], got["lookup_width"]) == ("speculative", "lookup", 4, 1)
    assert "beam_width" not in got
    assert decide([ar, good], 1.6)["decision"] == "ar"
    mlx_lm = {**_cell("mlx_lm", "none", 1.0, 3.0, 30.0), "decoder": "mlx_lm"}  # an external baseline never wins
    fp16_ar = _cell("ar", "none", 1.0, 1.0, 20.0, "float16")
    fp16 = _cell("rnn-w2-l4", "rnn", 1.8, 1.04, 20.8, "float16")
    got = decide([ar, good, mlx_lm, fp16_ar, fp16], 1.03)
    assert (got["decision"], got["dtype"], got["beam_width"]) == ("speculative", "float16", 2)


def test_tune_by_default_sweeps_the_modes_a_medusa_drafter_serves(tuned_file, tmp_path, target):
    """No --drafts: lookup and the drafter's own rows of the mode table, not the ReDrafter's."""
    from mlx_redrafter.draft.medusa import random_medusa
    from mlx_redrafter.draft.redrafter import save_drafter

    args = target.model.args
    path = save_drafter(random_medusa(args.hidden_size, args.vocab_size, seed=0, num_heads=3,
                                      draft_vocab_size=2048), tmp_path / "medusa")
    res = CliRunner().invoke(app, ["tune", "--drafter", str(path), "--widths", "2", "--lengths", "3",
                                   "--num-prompts", "1", "--max-tokens", "4", "--min-speedup", "1000", "--force"])
    assert res.exit_code == 0, res.output
    (entry,) = json.loads(tuned_file.read_text())["entries"].values()
    assert [c["config"] for c in entry["cells"]] == ["ar", "lookup-w2-l3", "medusa-w2-l3"]
