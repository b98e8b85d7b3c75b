"""Bad input ends with one line on stderr, a non-zero exit code and no traceback."""

import json
import os
import subprocess
import sys

import pytest
from forkserver import run_module

from mlx_redrafter.draft.redrafter import random_drafter, save_drafter
from tests.one_line import assert_one_line_error


def run_cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return run_module([sys.executable, "-m", "mlx_redrafter.cmd.main", *args], dict(os.environ), os.getcwd(), timeout)


@pytest.fixture(scope="module")
def wrong_drafters(tmp_path_factory):
    root = tmp_path_factory.mktemp("drafters")
    hidden = save_drafter(random_drafter(64, 49152, seed=0), root / "hidden64")
    vocab = save_drafter(random_drafter(576, 32000, seed=0, exit_dim=64), root / "vocab32000")
    return hidden, vocab


@pytest.mark.parametrize(
    "args,needles",
    [
        (["-p", "hi", "--beam-width", "0"], ["--beam-width"]),
        (["-p", "hi", "--beam-length", "1"], ["--beam-length"]),
        (["-p", "   "], ["prompt is empty"]),
        (["-p", "hi", "--dtype", "float64"], ["unknown dtype", "float64"]),
        (["-p", "hi", "--model", "/nonexistent/model.gguf"], ["does not exist"]),
        (["-p", "hi", "--model", "no-such-alias"], ["unknown model"]),
        (["-p", "hi", "--drafter", "/nonexistent/drafter"], ["drafter", "does not exist"]),
        (["-p", "hi", "--draft", "lookup-else-rnn", "--drafter-vocab", "9000"], ["--drafter-vocab", "8192"]),
        (["-p", "hi", "--draft-confidence", "1"], ["--draft-confidence", "[0, 1)"]),
        (["-p", "hi", "--draft-confidence", "nan"], ["--draft-confidence", "[0, 1)"]),
        (["-p", "hi", "--lookup-max-length", "-1"], ["--lookup-max-length", "from 0 to 64"]),
        (["-p", "hi", "--lookup-max-length", "1000000000"], ["--lookup-max-length", "from 0 to 64"]),
        (["-p", "hi", "--temp", "nan"], ["--temp", "finite"]),
        (["-p", "hi", "--top-p", "inf"], ["--top-p", "finite"]),
        (["-p", "hi", "--seed", "-1"], ["--seed", "from 0"]),
        (["-p", "hi", "-n", "-1"], ["--max-tokens", "from 1"]),
        (["-p", "hi", "--no-draft", "--draft", "rnn"], ["--no-draft", "--draft rnn"]),
        (["-p", "hi", "--drafter", "none", "--draft", "rnn"], ["--draft rnn needs", "none is loaded"]),
        (["-p", "hi", "--drafter", "random:-3"], ["random:SEED"]),
        (["-p", "hi", "--logprobs", "2"], ["--logprobs needs --json"]),
        (["-p", "hi", "--json", "--logprobs", "21"], ["--logprobs", "from 0 to 20"]),
        (["-p", "hi", "--logit-bias", "5"], ["--logit-bias", "'5' is not ID=BIAS"]),
        (["-p", "hi", "--logit-bias", "5=-101"], ["--logit-bias", "from -100 to 100"]),
        (["-p", "hi", "--logit-bias", "49152=1"], ["--logit-bias", "token id 49152", "vocabulary of 49152"]),
        (["-p", "hi", "--repetition-penalty", "-1"], ["--repetition-penalty", "from 0 to 10"]),
        (["-p", "hi", "--frequency-context-size", "0"], ["--frequency-context-size", "from 1 to 4096"]),
        (["-p", "hi", "--json-schema", '{"type": "objec"}'], ["--json-schema", "not usable", "objec"]),
        (["-p", "hi", "--json-schema", "/nonexistent/schema.json"], ["--json-schema file", "does not exist"]),
        (["-p", "hi", "--json-schema", " "], ["--json-schema is empty"]),
        (["-p", "hi", "--json-schema", '{"type": "string", "pattern": "(("}'], ["regex", "unclosed group", "'(('"]),
    ],
)
def test_bad_arguments(args, needles):
    assert_one_line_error(run_cli("generate", *args), *needles)


def test_corrupt_and_empty_model_files(tmp_path):
    from mlx_redrafter.models.loader import default_model_path

    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(default_model_path().read_bytes()[:1_000_000])
    assert_one_line_error(run_cli("generate", "-p", "hi", "--model", str(truncated)), "cannot read GGUF")
    headless = tmp_path / "headless.gguf"
    headless.write_bytes(b"GGUF" + b"\x00" * 64)
    assert_one_line_error(run_cli("generate", "-p", "hi", "--model", str(headless)), "GGUF version 0")
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a model at all")
    assert_one_line_error(run_cli("generate", "-p", "hi", "--model", str(garbage)), "cannot read GGUF")
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"not a model at all")
    assert_one_line_error(run_cli("generate", "-p", "hi", "--model", str(weights)), "is one file of a checkpoint")
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    assert_one_line_error(run_cli("generate", "-p", "hi", "--model", str(empty)), "empty")


def test_drafter_for_another_model(wrong_drafters):
    hidden, vocab = wrong_drafters
    assert_one_line_error(run_cli("generate", "-p", "hi", "--drafter", str(hidden)), "hidden_size 64", "576")
    assert_one_line_error(run_cli("generate", "-p", "hi", "--drafter", str(vocab)), "vocab_size 32000", "49152")


def test_prompt_longer_than_context():
    assert_one_line_error(run_cli("generate", "--raw", "-p", "hello " * 9000), "context is 8192")


def test_prompts_file_writes_one_json_per_line(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "Say hi."}) + "\n" + json.dumps({"prompt": "Count to 3."}) + "\n")
    proc = run_cli("generate", "--prompts-file", str(f), "--json", "--drafter", "random:0:64", "--draft", "rnn",
                   "-w", "2", "-l", "3", "-n", "12")
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(rows) == 2
    for row in rows:
        for key in ("text", "tokens", "prompt_tokens", "generated_tokens", "steps", "tokens_per_step",
                    "verified_tokens", "candidate_tokens", "decode_tokens_per_s", "prefill_s", "beam_width",
                    "beam_length", "dtype", "model", "drafter"):
            assert key in row
        assert row["generated_tokens"] == len(row["tokens"]) <= 12
        assert row["beam_width"] == 2 and row["beam_length"] == 3 and row["dtype"] == "float32"
        assert row["steps"] <= row["candidate_tokens"] <= 6 * row["steps"]  # adaptive: a failing source sits out
        assert "logprobs" not in row
    proc = run_cli("generate", "--prompts-file", str(f), "--json", "-n", "6", "--logprobs", "2", "-b", "2")
    assert proc.returncode == 0, proc.stderr
    for row in map(json.loads, proc.stdout.splitlines()):
        assert [e["token"] for e in row["logprobs"]] == row["tokens"]
        assert "".join(e["text"] for e in row["logprobs"]) == row["text"]
        assert all(len(e["top"]) == 2 and e["top"][0]["logprob"] == e["logprob"] <= 0 for e in row["logprobs"])


def test_chat_has_the_missing_drafter_rule_of_generate():
    """The same explicit mode without a drafter fails the same way in chat as in generate (not a silent fallback)."""
    got = [run_cli(cmd, *args, "--drafter", "none", "--draft", "rnn+lookup")
           for cmd, args in (("generate", ["-p", "hi"]), ("chat", []))]
    for proc in got:
        assert_one_line_error(proc, "--draft rnn+lookup needs a ReDrafter (rnn) drafter, but none is loaded")
    assert got[0].stderr == got[1].stderr


def test_a_range_list_too_long_to_hold_is_refused_before_it_is_built():
    from mlx_redrafter.cmd.common import int_list
    from mlx_redrafter.errors import UserError

    with pytest.raises(UserError, match="holds more than 100,000 values"):
        int_list("0-99999999999", "--shards")
    assert int_list("3,0-2", "--shards") == [0, 1, 2, 3]
    for bad in ("2,,3", "1,2,", "x"):
        with pytest.raises(UserError, match="takes comma-separated integers"):
            int_list(bad, "--lengths")
    with pytest.raises(UserError, match="--lengths is empty"):
        int_list(" ", "--lengths")
