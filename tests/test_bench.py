"""Benchmark harness end to end on the real model (tiny grid): CSV rows, JSON metadata, plots, README."""

from __future__ import annotations

import csv
import json

from bench.harness import COLUMNS, SweepSpec, read_prompts
from bench.run import run_bench


def test_tiny_bench_writes_everything(tmp_path):
    spec = SweepSpec(drafter="random:0", dtypes=["float32"], widths=[1, 2], lengths=[2], max_tokens=5,
                     warmup_tokens=2)
    res = run_bench("unit-test", spec, None, 1, out_root=tmp_path, profile=False, progress=False)
    out = tmp_path / "unit-test"
    rows = list(csv.DictReader((out / res["files"]["csv"]).open()))
    assert list(rows[0]) == COLUMNS
    assert sorted((r["method"], r["beam_width"], r["beam_length"]) for r in rows) == [
        ("ar", "0", "0"), ("mlx_lm", "0", "0"), ("redrafter", "1", "2"), ("redrafter", "2", "2")]
    for r in rows:
        assert r["device"] == "unit-test" and r["dtype"] == "float32" and r["model"] == "smollm2-135m"
        assert int(r["generated_tokens"]) >= 1 and float(r["decode_s"]) > 0
        assert 0.0 <= float(r["match_ar"]) <= 1.0
        if r["method"] == "redrafter":
            assert float(r["match_ar"]) == 1.0  # fp32 greedy: identical to AR
            assert r["drafter"] == "random:0"
            assert int(r["candidate_tokens"]) == int(r["beam_width"]) * 2 * int(r["steps"])
    meta = json.loads((out / res["files"]["json"]).read_text())
    assert meta["machine"]["backend"] in ("cpu", "metal", "cuda", "gpu") and meta["machine"]["mlx"]
    assert meta["settings"]["widths"] == [1, 2] and meta["settings"]["num_prompts"] == 1
    assert set(meta["best"]) == {"float32"}
    for key in ("speedup", "tokens_per_step", "time_split"):
        assert (out / res["files"][key]).read_bytes()[:4] == b"\x89PNG"
    assert "| float32 |" in (out / "README.md").read_text()
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temp files left behind


def test_prompts_spread_over_file():
    ps = read_prompts(None, 8)
    assert len(ps) == 8 and len({p.category for p in ps}) == 8  # MT-bench: 8 categories x 10
