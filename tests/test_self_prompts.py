"""Prompts written by the target itself (train/self_prompts.py, `redrafter-mlx self-prompts`) and the corpus of
its answers to them (`distill --source self`)."""

from __future__ import annotations

import json

from one_line import CLI, assert_one_line_error, run

from mlx_redrafter.api import LoadedModel
from mlx_redrafter.train.self_prompts import SOURCE, Filter, make_prompts, read_rows, user_turn_prefix


def test_filter_keeps_new_finished_prompts_and_counts_the_rest():
    f = Filter(exclude=["Compose an engaging travel blog post about a recent trip to Hawaii."])
    assert f.keep("  How do I bake sourdough bread at home?\n", True) == "How do I bake sourdough bread at home?"
    assert f.keep("how do i bake SOURDOUGH bread at home", True) is None  # the same words: a repeat
    assert f.keep("Write a story about a dragon who", False) is None  # the turn was not closed
    assert f.keep("Hi", True) is None  # too short
    assert f.keep("What is <|im_end|> for?", True) is None  # template tokens
    assert f.keep("Compose an engaging travel blog post about a recent trip to Hawaii", True) is None
    assert f.keep("compose an engaging travel blog post", True) is None  # inside a benchmark prompt
    assert f.dropped == {"repeated": 1, "unfinished": 1, "malformed": 2, "benchmark": 2}


def test_the_prefix_opens_a_user_message(target):
    tok = target.tokenizer
    prefix = user_turn_prefix(tok)
    rendered = tok.chat_prompt([{"role": "user", "content": "Hello there"}])
    assert tok.encode(rendered)[:len(prefix)] == prefix
    assert tok.decode(prefix).rstrip().endswith("user")


def test_make_prompts_samples_reproducibly_and_resumes(target, tmp_path):
    lm = LoadedModel(target=target, drafter=None, drafter_name="none")
    first = tmp_path / "a.jsonl"
    stats = make_prompts(lm, first, 3, seed=5, batch_size=4)
    rows = read_rows(first)
    assert stats["prompts"] == 3 and len(rows) == 3
    assert all(r["source"] == SOURCE and r["prompt"].strip() == r["prompt"] and r["prompt"] for r in rows)
    assert [r["attempt"] for r in rows] == sorted({r["attempt"] for r in rows})
    assert not (tmp_path / "a.jsonl.partial").exists()
    # an interrupted run (kept rows in .partial) continues after its last attempt: the same file in the end
    second = tmp_path / "b.jsonl"
    (tmp_path / "b.jsonl.partial").write_text(json.dumps(rows[0]) + "\n")
    make_prompts(lm, second, 3, seed=5, batch_size=2)
    assert read_rows(second) == rows


def test_distill_self_without_prompts_says_how_to_make_them(tmp_path):
    proc = run([*CLI, "distill", "--source", "self", "--corpus", str(tmp_path / "corpus")], tmp_path)
    assert_one_line_error(proc, "self-prompts")


def test_self_prompts_refuses_to_change_a_planned_file(tmp_path):
    out = tmp_path / "prompts.jsonl"
    out.write_text(json.dumps({"prompt": "What is a prime number?", "source": SOURCE, "attempt": 0}) + "\n")
    proc = run([*CLI, "self-prompts", "--num", "2", "--out", str(out), "--threads", "1"], tmp_path)
    assert_one_line_error(proc, "already holds 1 prompts")
    assert out.read_text().count("\n") == 1
    ok = run([*CLI, "self-prompts", "--num", "1", "--out", str(out), "--threads", "1"], tmp_path)
    assert ok.returncode == 0 and "already holds 1" in ok.stdout


def test_a_damaged_partial_file_is_a_one_line_error_and_kept(tmp_path):
    out, partial = tmp_path / "prompts.jsonl", tmp_path / "prompts.jsonl.partial"
    partial.write_bytes(b'{"prompt": "What is a prime\n\xff\xfe')
    proc = run([*CLI, "self-prompts", "--num", "2", "--out", str(out), "--threads", "1"], tmp_path)
    assert_one_line_error(proc, "is not a self-prompts file")
    assert partial.read_bytes().endswith(b"\xff\xfe") and not out.exists()


def test_prompts_of_another_file_are_not_repeated(target, tmp_path):
    lm = LoadedModel(target=target, drafter=None, drafter_name="none")
    first = tmp_path / "a.jsonl"
    make_prompts(lm, first, 2, seed=7, batch_size=2)
    again = make_prompts(lm, tmp_path / "b.jsonl", 2, seed=7, batch_size=2,
                         avoid=[r["prompt"] for r in read_rows(first)])
    assert again["dropped_this_run"].get("repeated", 0) >= 2  # the same seed samples the same turns first
    assert not {r["prompt"] for r in read_rows(tmp_path / "b.jsonl")} & {r["prompt"] for r in read_rows(first)}
    proc = run([*CLI, "self-prompts", "--num", "1", "--out", str(tmp_path / "c.jsonl"), "--avoid",
                str(tmp_path / "missing.jsonl")], tmp_path)
    assert_one_line_error(proc, "missing.jsonl")


def test_a_second_self_prompted_corpus_is_named_and_its_prompts_are_looked_for_there(tmp_path):
    proc = run([*CLI, "distill", "--source", "self", "--corpus", str(tmp_path / "corpus"), "--corpus-name",
                "smollm2-135m-self2"], tmp_path)
    assert_one_line_error(proc, "smollm2-135m-self2/prompts.jsonl", "self-prompts")
    bad = run([*CLI, "distill", "--source", "self", "--corpus", str(tmp_path / "corpus"), "--corpus-name", "a/b"],
              tmp_path)
    assert_one_line_error(bad, "--corpus-name takes a folder name")
