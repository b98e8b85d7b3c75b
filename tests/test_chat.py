"""Chat: a real session through a pseudo-terminal, and ChatSession's KV-cache reuse, interruption and context
overflow on the embedded model (greedy, short answers)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pexpect
import pytest

from mlx_redrafter import api
from mlx_redrafter.chat import ChatSession
from mlx_redrafter.errors import UserError

CLI = str(Path(sys.executable).parent / "redrafter-mlx")


@pytest.fixture(scope="module")
def lm(target):
    drafter, name = api.resolve_drafter("default", target)
    return api.LoadedModel(target=target, drafter=drafter, drafter_name=name)


def new_turn_ids(tok, question: str) -> list[int]:
    """Tokens ChatML adds for one more question after an answer (the answer's <|im_end|> included)."""
    return tok.encode(f"<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")


def test_chat_in_a_terminal(target, tmp_path):
    tok = target.tokenizer
    env = dict(os.environ, MKL_NUM_THREADS="1", REDRAFTER_TUNED_FILE=str(tmp_path / "none.json"))
    child = pexpect.spawn(CLI, ["chat", "--max-tokens", "96", "--temp", "0"], env=env, encoding="utf-8",
                          timeout=90, dimensions=(50, 200))
    try:
        child.expect_exact(">>> ")
        q1 = "What is the capital of France?"
        child.sendline(q1)
        child.expect(r"prefill (\d+) tokens")
        first_prefill = int(child.match.group(1))
        assert "Paris" in child.before  # the answer, streamed before its summary line
        assert first_prefill == len(tok.encode_chat([{"role": "user", "content": q1}]))
        child.expect_exact(">>> ")

        child.sendline("/stats")
        child.expect_exact(">>> ")
        stats = child.before
        assert re.search(r"last answer: \d+ tokens, [\d.]+ tok/s, [\d.]+ tokens per target call", stats)
        assert re.search(r"tokens per call by source: lookup [\d.]+, rnn [\d.]+", stats)
        assert int(re.search(r"prefill: (\d+) new tokens", stats).group(1)) == first_prefill

        q2 = "And the capital of Germany?"
        child.sendline(q2)
        child.expect(r"prefill (\d+) tokens")
        second_prefill = int(child.match.group(1))
        assert "Berlin" in child.before
        # only the new turn is prefilled (+ at most the previous answer's last token, not yet in the cache)
        k = len(new_turn_ids(tok, q2))
        assert k <= second_prefill <= k + 1
        child.expect_exact(">>> ")

        child.sendline("Write a very long story about a dragon who loves to read books.")
        child.expect_exact("books.\r\n")  # the echo of the question
        child.expect(r"\w+ \w+")  # the answer is streaming
        time.sleep(0.3)
        child.sendintr()  # Ctrl-C in the middle of the answer
        child.expect_exact("answer stopped")
        child.expect_exact(">>> ")

        q4 = "What is 2 + 2?"
        child.sendline(q4)
        child.expect(r"prefill (\d+) tokens")
        k = len(new_turn_ids(tok, q4))
        assert k <= int(child.match.group(1)) <= k + 1  # the stopped answer stayed in the cache and history
        child.expect_exact(">>> ")
        child.sendline("/stats")
        child.expect(r"session: 4 answers, \d+ tokens generated; prefilled (\d+) tokens \((\d+) without")
        prefilled, without = int(child.match.group(1)), int(child.match.group(2))
        assert prefilled < without / 2  # what KV-cache reuse saves over four turns
        child.expect_exact(">>> ")

        child.sendline("/reset")
        child.expect_exact("[new conversation]")
        child.expect_exact(">>> ")
        child.sendline(q1)
        child.expect(r"prefill (\d+) tokens")
        assert int(child.match.group(1)) == first_prefill  # a new conversation starts from scratch
        child.expect_exact(">>> ")

        child.sendline("/help")
        child.expect_exact("/reset")
        child.expect_exact(">>> ")
        child.sendeof()  # Ctrl-D quits cleanly
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0, child.before
    assert "Traceback" not in (child.before or "")


def test_ctrl_c_at_the_prompt_quits(tmp_path):
    env = dict(os.environ, MKL_NUM_THREADS="1", REDRAFTER_TUNED_FILE=str(tmp_path / "none.json"))
    # A shell that runs a job in the background hands it SIGINT ignored, and Python then keeps it ignored: give
    # the chat the disposition a terminal user's shell gives it, wherever the suite runs.
    child = pexpect.spawn(CLI, ["chat", "--no-draft"], env=env, encoding="utf-8", timeout=60,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    child.expect_exact(">>> ")
    child.sendintr()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0 and "Traceback" not in child.before


def test_second_turn_reuses_the_cache_and_answers_as_a_fresh_prompt(lm):
    options = api.decode_options(max_tokens=16)
    session = ChatSession(lm, options)
    a1 = "".join(session.send("Name a color."))
    a2 = "".join(session.send("Name another one."))
    assert session.last.prefill_tokens <= len(new_turn_ids(lm.tokenizer, "Name another one.")) + 1
    msgs = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": a1},
            {"role": "user", "content": "Name another one."}]
    fresh = api.generate(lm, lm.tokenizer.encode_chat(msgs), options)
    assert fresh.text == a2  # KV-cache reuse changes nothing in what is generated


def committed_matches_fresh_prefill(session) -> bool:
    model = session.lm.target.model
    cache = model.make_cache(len(session.tokens) + 8)
    model(mx.array([session.tokens]), cache)
    cache.advance(len(session.tokens))
    assert session.cache.offset == len(session.tokens)
    return all(mx.abs(session.cache.committed(i)[0] - cache.committed(i)[0]).max().item() < 1e-3
               for i in (0, model.args.num_hidden_layers - 1))


def test_stopped_answer_stays_consistent(lm):
    session = ChatSession(lm, api.decode_options(max_tokens=64))
    pieces = []
    for piece in session.send("Tell me a long story about a cat.", stop=lambda: len(pieces) >= 3):
        pieces.append(piece)
    assert session.last.stop == "interrupted"
    assert session.messages[-1] == {"role": "assistant", "content": "".join(pieces)}
    assert committed_matches_fresh_prefill(session)
    answer = "".join(session.send("What is the capital of Italy?"))
    assert "Rome" in answer
    assert committed_matches_fresh_prefill(session)


def test_context_overflow_drops_the_oldest_turns(lm):
    session = ChatSession(lm, api.decode_options(max_tokens=16, draft="lookup"), system="Be brief.",
                          max_context=80)
    dropped = 0
    for q in ["What is the capital of France?", "And of Spain?", "And of Portugal?", "And of Greece?"]:
        "".join(session.send(q))
        dropped += session.last.dropped_turns
        assert session.last.prompt_tokens + len(session.last.tokens) <= 80
        assert session.messages[0] == {"role": "system", "content": "Be brief."}
    assert dropped > 0 and session.totals.dropped_turns == dropped
    assert committed_matches_fresh_prefill(session)
    before = list(session.messages)
    with pytest.raises(UserError, match="too long"):
        "".join(session.send("word " * 200))
    assert session.messages == before  # the rejected message left no trace


def test_without_a_drafter_auto_drafts_by_lookup_and_a_drafter_mode_is_an_error(target):
    """One rule for a missing drafter, the same as `generate`'s: auto uses lookup; a mode naming a drafter fails."""
    bare = api.LoadedModel(target=target, drafter=None, drafter_name="none")
    assert ChatSession(bare, api.decode_options(draft="auto")).mode.name == "lookup"
    for mode in ("rnn", "rnn+lookup", "lookup-else-rnn", "medusa", "semi_ar"):
        with pytest.raises(UserError, match=f"--draft {re.escape(mode)} needs a .* drafter, but none is loaded"):
            ChatSession(bare, api.decode_options(draft=mode))


def chat_piped(lines: list[str], *args: str, tmp_path) -> subprocess.CompletedProcess:
    env = dict(os.environ, MKL_NUM_THREADS="1", REDRAFTER_TUNED_FILE=str(tmp_path / "none.json"))
    return subprocess.run([CLI, "chat", *args], input="".join(f"{line}\n" for line in lines), capture_output=True,
                          text=True, env=env, timeout=300)


def test_set_changes_the_next_answers_options_and_the_system_prompt(target, tmp_path):
    tok = target.tokenizer
    system, question = "You are a pirate.", "Who are you?"
    proc = chat_piped(["/set max-tokens 5", "Tell me a story.", "/set draft none", "/set --temp 0.8",
                       "/set seed 3", question, f"/set system {system}", question, "/set"], "-n", "40",
                      tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "[max-tokens = 5]" in proc.stdout and "[--temp = 0.8]" in proc.stdout
    summaries = re.findall(r"\[(\d+) tokens, [\d.]+ tok/s, ([\d.]+) tokens/call, prefill (\d+) tokens", proc.stderr)
    assert [int(n) for n, _, _ in summaries] == [5, 5, 5]
    assert [float(c) for _, c, _ in summaries[1:]] == [1.0, 1.0]  # --draft none from the second answer on
    assert "[system prompt set; new conversation]" in proc.stdout
    fresh = tok.encode_chat([{"role": "system", "content": system}, {"role": "user", "content": question}])
    assert int(summaries[2][2]) == len(fresh)  # the new system prompt, in a new conversation
    assert "draft=none temperature=0.8 " in proc.stdout and "seed=3" in proc.stdout and "system: 'You are" in \
        proc.stdout


@pytest.mark.parametrize("line,args,needle", [
    ("/set top-k many", (), "/set top-k: 'many' is not an integer"),
    ("/set temp -1", (), "--temp must be a finite number >= 0"),
    ("/set warp 9", (), "/set warp: unknown option"),
    ("/set beam-length", (), "/set beam-length needs one value"),
    ("/set draft rnn", ("--drafter", "none"), "--draft rnn needs a ReDrafter"),
])
def test_a_bad_set_is_one_error_line_and_piped_input_ends(line, args, needle, tmp_path):
    proc = chat_piped([line, "not reached"], "-n", "4", *args, tmp_path=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0], proc.stderr  # after the banner, one line
    assert "tokens/call" not in proc.stderr  # nothing was answered after it


def test_a_refused_option_leaves_the_session_as_it_was(lm):
    session = ChatSession(lm, api.decode_options(max_tokens=7))
    with pytest.raises(UserError, match="--beam-length"):
        session.set_options(beam_length=1)
    assert session.options.shape.length != 1 and session.options.max_tokens == 7
    session.set_options(draft="lookup", temperature=0.5)
    assert session.mode.name == "lookup" and session.options.sampling.temperature == 0.5


def test_set_json_schema_takes_the_rest_of_the_line_and_none_clears_it(lm):
    from mlx_redrafter.cmd.chat import _set

    lm = api.LoadedModel(lm.target, lm.drafter, lm.drafter_name)  # paired again: a test above paired the target bare
    session = ChatSession(lm, api.decode_options(max_tokens=24))
    shown = _set(session, 'json-schema {"type": "object", "properties": {"wet": {"type": "boolean"}}, '
                          '"required": ["wet"]}')
    assert "[answers follow the JSON schema]" in shown and "json-schema=on" in shown
    answer = json.loads("".join(session.send("Is water wet?")))
    assert set(answer) == {"wet"} and isinstance(answer["wet"], bool)
    with pytest.raises(UserError, match="--json-schema"):
        _set(session, "json-schema {not json")
    assert session.options.json_schema is not None  # a refused schema leaves the one in use
    assert "answers in free text" in _set(session, "json-schema none") and session.options.json_schema is None
    assert "json-schema=on" not in _set(session, "")
