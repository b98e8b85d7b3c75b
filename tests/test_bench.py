"""The repo benchmark (`python -m bench sweep`) end to end on the real model with a tiny grid."""

from __future__ import annotations

import csv
import json
import re
import sys
from pathlib import Path

from typer.testing import CliRunner

from bench.__main__ import app
from bench.compare import write_comparison
from bench.report import COLUMNS
from bench.run import BenchSpec, run_bench

ROOT = Path(__file__).resolve().parents[1]


def test_tiny_sweep_writes_everything(tmp_path):
    spec = BenchSpec(device="unit-test", drafter="random:0", drafts="rnn,lookup", dtypes=["float32"], widths=[1],
                     lengths=[2], max_tokens=5, num_prompts=1, warmup_tokens=2, llama_cpp=False)
    res = run_bench(spec, tmp_path, progress=False)
    out = tmp_path / "unit-test"
    assert res["dir"] == out
    with (out / res["files"]["csv"]).open() as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == COLUMNS
        rows = list(reader)
    assert sorted(r["config"] for r in rows) == ["ar", "lookup-w1-l2", "mlx_lm", "rnn-w1-l2"]
    for r in rows:
        assert r["device"] == "unit-test" and r["dtype"] == "float32" and r["model"] == "smollm2-135m"
        assert r["temperature"] == "0" and r["prompt_id"] == "81" and r["repeats"] == "1"
        assert int(r["generated_tokens"]) >= 1 and float(r["decode_s"]) > 0
        assert float(r["decode_s_min"]) <= float(r["decode_s"]) <= float(r["decode_s_max"])
        assert r["load1_before"] and r["load1_after"] and r["mlx_lm_decode_tokens_per_s"]
        if r["draft"] != "none":  # fp32 greedy: speculative output is AR's, token for token
            assert r["equal_ar"] == "True" and float(r["match_ar"]) == 1.0
            assert float(r["draft_s"]) >= 0 and float(r["verify_s"]) > 0
    rnn = next(r for r in rows if r["config"] == "rnn-w1-l2")
    assert (rnn["drafter"], rnn["beam_width"], rnn["lookup_width"]) == ("random:0", "1", "0")
    assert int(rnn["candidate_tokens"]) == 2 * int(rnn["steps"]) and rnn["rnn_tokens_per_step"]
    lookup = next(r for r in rows if r["config"] == "lookup-w1-l2")
    assert (lookup["draft"], lookup["beam_width"], lookup["lookup_width"]) == ("lookup", "0", "1")

    meta = json.loads((out / res["files"]["json"]).read_text())
    assert meta["machine"]["backend"] in ("cpu", "metal", "cuda", "gpu") and meta["machine"]["mlx"]
    assert isinstance(meta["quiet"], bool)
    (state,) = meta["machine_state"]
    assert state["before"]["loadavg"] and state["after"]["loadavg"] and state["quiet"] == meta["quiet"]
    assert meta["settings"]["widths"] == [1] and meta["settings"]["num_prompts"] == 1
    assert sorted(b["draft"] for b in meta["best"]) == ["lookup", "rnn"]
    assert {s["config"] for s in meta["summary"]} == {r["config"] for r in rows}
    ar = next(s for s in meta["summary"] if s["config"] == "ar")
    assert ar["speedup_vs_ar_mean"] == ar["speedup_vs_ar_median"] == 1.0 and abs(ar["speedup_vs_ar"] - 1) < 1e-9
    assert meta["profile"]["steps"] > 0 and {"draft", "verify", "commit"} <= set(meta["profile"]["phase_ms_per_step"])
    for key in ("speedup", "tokens_per_step", "time_split"):
        assert (out / res["files"][key]).read_bytes()[:4] == b"\x89PNG"
    readme = (out / "README.md").read_text()
    assert any(line.startswith("Machine state (float32 sweep") for line in readme.splitlines()[:4])
    assert "| rnn | float32 | 0 | greedy | 1 | 2 |" in readme and "Step profile" in readme
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no temp files left behind

    report = write_comparison(out)  # the drafter comparison reads the same sweep: one row per draft mode found
    assert [r["drafter"] for r in report["rows"]] == ["lookup (no training)", "redrafter (shipped)"]
    assert all(r["equal_ar"] == 1.0 and r["width"] == 1 and r["beam_length"] == 2 for r in report["rows"])
    assert "| redrafter (shipped) | - | - | - | 1 | 2 |" in (out / "drafter-comparison.md").read_text()


def test_llama_cpp_is_a_baseline_where_it_is_installed(tmp_path):
    """llama.cpp's greedy decoding of the same GGUF runs beside ours and every row is compared with it (skipped
    where llama-cpp-python is not installed: `make .venv/.llama-cpp` compiles it, ~15 minutes)."""
    import pytest

    from bench.llama_cpp_ref import available

    if not available():
        pytest.skip("llama-cpp-python is not installed (make .venv/.llama-cpp)")
    # A prompt whose first token wins by a clear margin (1 logit): llama.cpp's 8-bit activations break near-ties
    # otherwise (MT-bench's first prompt: its top three within 0.1, and the AVX-512 build picks another token).
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "test", "turns": ["Name three primary colors."]}))
    spec = BenchSpec(device="unit-test", drafter="random:0", drafts="lookup", dtypes=["float32"], widths=[1],
                     lengths=[2], max_tokens=8, num_prompts=1, warmup_tokens=2, mlx_lm=False, profile=False,
                     prompts_file=prompts)
    res = run_bench(spec, tmp_path, progress=False)
    with (tmp_path / "unit-test" / res["files"]["csv"]).open() as f:
        rows = {r["config"]: r for r in csv.DictReader(f)}
    assert sorted(rows) == ["ar", "llama_cpp", "lookup-w1-l2"]
    ref = rows["llama_cpp"]
    assert ref["decoder"] == "llama_cpp" and 1 <= int(ref["generated_tokens"]) <= 8 and float(ref["decode_s"]) > 0
    assert float(rows["ar"]["llama_cpp_decode_tokens_per_s"]) == float(ref["decode_tokens_per_s"])
    assert float(rows["ar"]["speedup_vs_llama_cpp"]) > 0 and float(ref["match_ar"]) > 0  # its ids start as ours
    readme = (tmp_path / "unit-test" / "README.md").read_text()
    assert "llama.cpp ids vs ours" in readme and "| llama.cpp tok/s |" in readme


def test_llama_cpp_asked_for_where_it_cannot_run_is_one_error_line(monkeypatch):
    import bench.llama_cpp_ref as ref
    from bench.run import llama_cpp_file
    from mlx_redrafter import api
    from mlx_redrafter.errors import UserError

    lm = api.load(None, drafter=None)
    spec = BenchSpec(device="unit-test", llama_cpp=True)
    monkeypatch.setattr(ref, "available", lambda: False)  # as on a machine without the optional extra
    try:
        llama_cpp_file(spec, lm)
        raise AssertionError("no error")
    except UserError as e:
        assert "llama-cpp-python is not installed" in str(e) and "make .venv/.llama-cpp" in str(e)
    assert llama_cpp_file(BenchSpec(device="unit-test"), lm) is None  # by default: measured where installed
    assert llama_cpp_file(BenchSpec(device="unit-test", llama_cpp=False), lm) is None


def test_a_llama_cpp_worker_that_cannot_start_is_one_error_line(tmp_path, capfd):
    """A worker that fails (a missing file here; where llama-cpp-python is not installed, its import) says one
    `error:` line and the benchmark raises a one-line UserError: no traceback."""
    import pytest

    from bench.llama_cpp_ref import LlamaCppDecoder
    from mlx_redrafter.errors import UserError
    from mlx_redrafter.options import DecodeOptions

    decoder = LlamaCppDecoder(tmp_path / "missing.gguf", [2], 512)
    with pytest.raises(UserError, match="llama.cpp worker ended .*--no-llama-cpp"):
        decoder([1, 2, 3], DecodeOptions(draft="none", max_tokens=4))
    err = capfd.readouterr().err
    assert err.startswith("error: llama.cpp: ") and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_sweep_rewrites_only_its_own_section_of_the_readme(tmp_path):
    """A results folder's hand-kept README (an index of runs) survives every sweep; the latest sweep's section is
    replaced, never repeated."""
    from bench.report import BEGIN, END, write_section

    path = tmp_path / "README.md"
    path.write_text("# Benchmark results: x\n\n| run | what |\n|---|---|\n| `bench-1` | a hand-kept row |\n")
    write_section(path, "# Benchmark results: x\n\nLatest run `run-1`.\n")
    write_section(path, "# Benchmark results: x\n\nLatest run `run-2`.\n")
    text = path.read_text()
    assert text.startswith("# Benchmark results: x\n\n| run | what |") and "a hand-kept row" in text
    assert text.count(BEGIN) == text.count(END) == 1 and "run-2" in text and "run-1" not in text
    fresh = tmp_path / "new.md"
    write_section(fresh, "# Benchmark results: y\n\nLatest run `run-3`.\n")
    assert fresh.read_text().splitlines()[:3] == ["# Benchmark results: y", "", BEGIN]


def test_temperature_axis_compares_acceptance_rules(target):
    """At T > 0 every cell runs once per acceptance rule, against one AR at that temperature."""
    from bench.run import configs_for
    from mlx_redrafter.api import LoadedModel
    from mlx_redrafter.sweep import _ar_names

    spec = BenchSpec(device="unit-test", drafts="lookup", temperatures=[0.0, 0.7], accepts=["exact", "typical"],
                     widths=[1], lengths=[3], mlx_lm=False, llama_cpp=False)
    configs = configs_for(spec, LoadedModel(target, None, "none"))
    assert [c.name for c in configs] == ["ar", "lookup-w1-l3", "ar@t0.7", "lookup-w1-l3@t0.7",
                                         "lookup-w1-l3@t0.7-typical"]
    assert [c.options.sampling.accept for c in configs] == ["exact"] * 4 + ["typical"]
    assert _ar_names(configs)["lookup-w1-l3@t0.7-typical"] == "ar@t0.7"


def test_bad_input_is_one_line_error(tmp_path):
    for args, needle in ((["sweep", "--device", "no/slash", "--out-dir", str(tmp_path)], "--device"),
                         (["sweep", "--device", "x", "--widths", "0", "--out-dir", str(tmp_path)], "--widths"),
                         (["sweep", "--device", "x", "--temperatures", "hot", "--out-dir", str(tmp_path)],
                          "--temperatures"),
                         (["sweep", "--device", "x", "--drafts", "bogus", "--out-dir", str(tmp_path)], "--drafts"),
                         (["parity", "--device", "tpu"], "--device"),
                         (["calibration", "--device", "x", "--length", "1"], "--length")):
        res = CliRunner().invoke(app, args)
        lines = [ln for ln in res.output.splitlines() if ln.strip()]
        assert res.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], (
            args, res.output)
    assert not any(tmp_path.iterdir())


def test_bench_is_a_repo_tool_not_installed():
    text = (ROOT / "pyproject.toml").read_text()
    find = re.search(r"\[tool\.setuptools\.packages\.find\]\s*include = (\[[^\]]*\])", text)
    assert find and "mlx_redrafter*" in find.group(1) and "bench" not in find.group(1)
    assert sys.modules["bench"].__file__.startswith(str(ROOT / "bench"))


def test_pooled_speedup_weighs_prompts_by_time():
    """A short prompt at 2x and a long one at 1x: the mean of ratios says 1.5x, the whole set ran 1.05x faster."""
    from mlx_redrafter.sweep import pooled_speedup

    rows = [{"generated_tokens": 11, "decode_s": 0.5, "ar_decode_tokens_per_s": 10.0},  # 10 tokens: AR 1 s
            {"generated_tokens": 101, "decode_s": 10.0, "ar_decode_tokens_per_s": 10.0}]  # 100 tokens: AR 10 s
    assert abs(pooled_speedup(rows) - 11 / 10.5) < 1e-12


def test_the_headline_speedup_is_pooled_over_prompts():
    """A copy-heavy prompt that is 4x faster and a long one 1.25x slower: the mean of ratios says 2.2x; the pooled
    speedup (AR's time over the config's, same tokens) is what a user waiting on both sees."""
    from mlx_redrafter.sweep import summarize

    def row(prompt: str, tokens: int, ar_tok_s: float, tok_s: float) -> dict:
        return {"config": "rnn-w1-l4", "decoder": "ours", "model": "m", "dtype": "float32", "draft": "rnn",
                "drafter": "d", "beam_width": 1, "beam_length": 4, "lookup_width": 0, "lookup": "none",
                "temperature": 0.0, "prompt_id": prompt, "generated_tokens": tokens + 1, "decode_s": tokens / tok_s,
                "decode_s_min": tokens / tok_s, "decode_s_max": tokens / tok_s, "decode_tokens_per_s": tok_s,
                "ar_decode_tokens_per_s": ar_tok_s, "speedup_vs_ar": tok_s / ar_tok_s, "tokens_per_step": 2.0,
                "equal_ar": True, "match_ar": 1.0, "steps": tokens // 2, "verified_tokens": tokens * 2,
                "candidate_tokens": tokens * 2, "source_tokens_per_step": {}, "phase_s": {}, "peak_memory_gb": 0.1}

    (s,) = summarize([row("copy", 100, 50.0, 200.0), row("long", 900, 50.0, 40.0)])
    assert abs(s["speedup_vs_ar_mean"] - (4.0 + 0.8) / 2) < 1e-9
    ar_time, time = 100 / 50 + 900 / 50, 100 / 200 + 900 / 40
    assert abs(s["speedup_vs_ar"] - ar_time / time) < 1e-9 and s["speedup_vs_ar"] < 1
    assert (s["speedup_vs_ar_min"], s["speedup_vs_ar_max"]) == (0.8, 4.0)


def test_calibration_bins_every_drafted_position(target):
    """`python -m bench calibration`'s core on one prompt: every position lands in one bin, acceptance is a share."""
    from bench.calibration import markdown, measure
    from mlx_redrafter import api

    lm = api.LoadedModel(target, *api.resolve_drafter("default", target))
    ids = api.encode_prompt(lm, "Name three colours.")
    res = measure(lm, [ids], max_tokens=16, length=4, log=None)
    assert res["positions"] > 0 and len(res["steps"]) == len(res["joint"]) == 3
    first = res["steps"][0]
    assert first["positions"] == res["positions"] == sum(b["n"] for b in first["bins"])
    assert all(0 <= b["accepted"] <= 1 for r in res["steps"] + res["joint"] for b in r["bins"] if b["n"])
    assert "draft 1" in markdown(res, "t")


def test_drafter_ab_interleaves_and_checks_every_output(tmp_path):
    res = CliRunner().invoke(app, ["ab", "--drafter", "default", "--drafter", "random:0", "--rounds", "1",
                                   "--per-set", "1", "--max-tokens", "6", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    report = json.loads((tmp_path / "ab.json").read_text())
    assert report["identical_to_ar"] is True and report["sets"] == {"mt-bench": 1}
    cells = {(r["drafter"], r["mode"], r["set"]) for r in report["rows"]}
    assert cells == {("ar", "none", s) for s in ("all", "mt-bench")} | {
        (d, m, s) for d in ("default", "random:0") for m in ("auto", "rnn") for s in ("all", "mt-bench")}
    assert all(r["tokens"] > 0 and r["speed_vs_ar"] > 0 for r in report["rows"])
    assert (tmp_path / "ab.md").read_text().startswith("# Drafter A/B")
    bad = CliRunner().invoke(app, ["ab", "--drafter", "default", "--rounds", "0", "--out", str(tmp_path / "x")])
    assert bad.exit_code == 2 and bad.output.strip().startswith("error: ") and "--rounds" in bad.output


def test_drafter_ab_checks_its_output_folder_before_decoding(tmp_path):
    (tmp_path / "afile").write_text("")
    res = CliRunner().invoke(app, ["ab", "--drafter", "default", "--out", str(tmp_path / "afile")])
    assert res.exit_code == 2 and res.output.strip().startswith("error: --out") and "is a file" in res.output
