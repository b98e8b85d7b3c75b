"""`redrafter-mlx serve`: a real server process on 127.0.0.1 driven by the official `openai` client."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import shutil
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from mlx_redrafter import api
from mlx_redrafter.options import DecodeOptions
from mlx_redrafter.server.protocol import ApiError
from mlx_redrafter.server.scheduler import Job, Scheduler
from mlx_redrafter.server.tools import parse_tools, template_messages

KEY = "sk-test-key"
QUESTION = "Name three primary colors."


def _env(tmp_path) -> dict[str, str]:
    return {**os.environ, "MKL_NUM_THREADS": "1", "REDRAFTER_TUNED_FILE": str(tmp_path / "none.json"),
            "REDRAFTER_STEP_COSTS": "curve"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _quiet_curve(tuned_dir) -> None:
    """Give the server a cost curve of this machine's shape measured quiet (batch/budget.py), instead of the one it
    measures at its first batched step: three noisy points measured beside the rest of a loaded test run once made
    longer candidates look expensive, the server verified two tokens a step, and a predicted answer had 31 of its 64
    tokens accepted. The server prices steps by this curve alone (REDRAFTER_STEP_COSTS=curve in `_env`): the
    budget's in-run timings did the same on a loaded CI machine (a copy decoded in plain steps, a predicted answer
    had 26 of 64 tokens accepted). What the tests assert then does not depend on the load."""
    from mlx_redrafter.batch.budget import CostCurve, curve_file
    from mlx_redrafter.system.machine import fingerprint
    from mlx_redrafter.tuning import tuned_file

    os.environ["REDRAFTER_TUNED_FILE"], before = str(tuned_dir / "none.json"), os.environ.get("REDRAFTER_TUNED_FILE")
    try:
        path = curve_file("smollm2-135m", fingerprint())
        assert path.parent == tuned_file().parent == tuned_dir
    finally:
        if before is None:
            del os.environ["REDRAFTER_TUNED_FILE"]
        else:
            os.environ["REDRAFTER_TUNED_FILE"] = before
    CostCurve({b: [0.03 * b * (1 + 0.1 * p) for p in range(12)] for b in range(1, 9)}, context=128).save(path)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = _free_port()
    tuned = tmp_path_factory.mktemp("tuned")
    _quiet_curve(tuned)
    env = _env(tuned)
    log = tmp_path_factory.mktemp("server") / "server.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "mlx_redrafter.cmd.main", "serve", "--port", str(port),
                                 "--api-key", KEY, "--max-active", "3"], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, log.read_text()
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert "Traceback" not in log.read_text(), log.read_text()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def lm(target):
    drafter, name = api.resolve_drafter("default", target)
    return api.LoadedModel(target, drafter, name)


def _chat(question: str = QUESTION) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


def test_models_and_health(server, client):
    (m,) = client.models.list().data
    assert m.id == "smollm2-135m"
    assert httpx.get(f"{server}/health").json()["status"] == "ok"


def test_greedy_chat_equals_the_library_and_reports_speculation(client, lm):
    res = client.chat.completions.create(model="smollm2-135m", messages=_chat(), max_tokens=40)
    assert res.choices[0].message.content == api.generate(lm, QUESTION, max_tokens=40).text
    assert res.choices[0].finish_reason in ("stop", "length")
    extra = res.usage.model_extra["redrafter"]
    assert extra["draft"] == "lookup-else-rnn" and extra["tokens_per_call"] >= 1.0
    assert res.usage.completion_tokens > 0 and res.usage.prompt_tokens > 0


def test_a_logit_bias_and_penalties_answer_what_the_library_answers_with_them(client, lm):
    first = api.generate(lm, QUESTION, max_tokens=12).tokens[0]
    penalties = {"repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_context_size": 30}
    want = api.generate(lm, QUESTION, max_tokens=24, logit_bias={first: -100}, **penalties)
    for draft in ("none", "lookup-else-rnn"):
        res = client.chat.completions.create(model="smollm2-135m", messages=_chat(), max_tokens=24,
                                             logit_bias={str(first): -100}, presence_penalty=0.5,
                                             extra_body={"draft": draft, "repetition_penalty": 1.3,
                                                         "frequency_context_size": 30})
        assert res.choices[0].message.content == want.text and first not in want.tokens


def test_streaming_sends_the_same_text_with_origins_and_usage(server, client):
    kwargs = {"model": "smollm2-135m", "messages": _chat(), "max_tokens": 40}
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    origins = {c.model_extra["redrafter"]["origin"] for c in chunks if c.choices and c.model_extra.get("redrafter")}
    assert "target" in origins and origins <= {"target", "draft:rnn", "draft:lookup", "draft:answers"}


def test_response_format_makes_json_that_the_library_makes(client, lm):
    schema = {"type": "object", "properties": {"colors": {"type": "array", "items": {"type": "string"},
                                                          "maxItems": 3}}, "required": ["colors"],
              "additionalProperties": False}
    want = api.generate(lm, QUESTION, max_tokens=48, json_schema=schema).text
    fmt = {"type": "json_schema", "json_schema": {"name": "colors", "schema": schema}}
    res = client.chat.completions.create(model="smollm2-135m", messages=_chat(), max_tokens=48, response_format=fmt)
    assert res.choices[0].message.content == want and isinstance(json.loads(want)["colors"], list)
    anything = client.chat.completions.create(model="smollm2-135m", messages=_chat("Say hi."), max_tokens=48,
                                              response_format={"type": "json_object"}, temperature=0.8, seed=1)
    assert anything.choices[0].message.content.lstrip().startswith("{")
    plain = client.chat.completions.create(model="smollm2-135m", messages=_chat(), max_tokens=8,
                                           response_format={"type": "text"})
    assert plain.choices[0].message.content == api.generate(lm, QUESTION, max_tokens=8).text


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city today.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False}}}


def test_tools_are_called_in_openais_format_streamed_or_not(client):
    ask = _chat("What is the weather in Paris?")
    res = client.chat.completions.create(model="smollm2-135m", messages=ask, tools=[WEATHER], tool_choice="required",
                                         max_tokens=64)
    choice = res.choices[0]
    (call,) = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}
    chunks = list(client.chat.completions.create(model="smollm2-135m", messages=ask, tools=[WEATHER],
                                                 tool_choice="required", max_tokens=64, stream=True))
    calls = [tc for c in chunks if c.choices and c.choices[0].delta.tool_calls for tc in c.choices[0].delta.tool_calls]
    assert calls[0].id.startswith("call_") and calls[0].function.name == "get_weather" and calls[0].type == "function"
    assert len(calls) > 1 and {tc.index for tc in calls} == {0}  # the arguments stream as the model writes them
    streamed = "".join(tc.function.arguments for tc in calls)
    assert json.loads(streamed) == json.loads(call.function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    result = [*ask, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
              {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 C."}]
    after = client.chat.completions.create(model="smollm2-135m", messages=result, tools=[WEATHER], max_tokens=64)
    assert after.choices[0].message.tool_calls or after.choices[0].message.content  # auto: a call or an answer
    plain = client.chat.completions.create(model="smollm2-135m", messages=ask, tools=[WEATHER], tool_choice="none",
                                           max_tokens=8)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content


def test_a_direct_answer_beside_tools_streams_its_text_as_it_is_written(client):
    kwargs = {"model": "smollm2-135m", "messages": _chat("Say hello to me in one sentence."), "tools": [WEATHER],
              "max_tokens": 40}
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.message.tool_calls is None and whole.message.content
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    texts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(texts) == whole.message.content and len(texts) > 1  # in pieces, not whole at the end
    assert '"response"' not in "".join(texts) and chunks[-1].choices[0].finish_reason == whole.finish_reason

def test_parallel_tool_calls_come_back_as_one_call_each(client, lm):
    ask = _chat("What is the weather in Paris and in London?")
    res = client.chat.completions.create(model="smollm2-135m", messages=ask, tools=[WEATHER], tool_choice="required",
                                         parallel_tool_calls=True, max_tokens=96)
    choice = res.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}
    assert len({call.id for call in choice.message.tool_calls}) == len(choice.message.tool_calls)
    tools = parse_tools([WEATHER], "required", True)  # the library under the same schema writes the same calls
    ids = lm.tokenizer.encode_chat(template_messages(ask, tools))
    want = api.generate(lm, ids, max_tokens=96, json_schema=tools.schema()).text
    assert [c.function.arguments for c in choice.message.tool_calls] == \
        [json.dumps(c["arguments"]) for c in json.loads(want)["tool_calls"]]
    results = [{"role": "tool", "tool_call_id": c.id, "content": "Sunny."} for c in choice.message.tool_calls]
    after = client.chat.completions.create(
        model="smollm2-135m", messages=[*ask, choice.message.model_dump(exclude_none=True), *results],
        tools=[WEATHER], parallel_tool_calls=True, max_tokens=32)
    assert after.choices[0].message.tool_calls or after.choices[0].message.content

def test_completions_stop_strings_and_seeds(client):
    res = client.completions.create(model="smollm2-135m", prompt="1, 2, 3, 4, 5,", max_tokens=20)
    assert res.choices[0].text.strip()
    stopped = client.completions.create(model="smollm2-135m", prompt="1, 2, 3, 4, 5,", max_tokens=20,
                                        stop=["8"])
    assert "8" not in stopped.choices[0].text and stopped.choices[0].finish_reason == "stop"
    assert res.choices[0].text.startswith(stopped.choices[0].text)
    sampled = [client.chat.completions.create(model="smollm2-135m", messages=_chat("Tell me a story."),
                                              max_tokens=24, temperature=0.9, seed=seed).choices[0].message.content
               for seed in (3, 3, 4)]
    assert sampled[0] == sampled[1] != sampled[2]


def test_log_probabilities_are_the_librarys_streamed_or_not(client, lm):
    kwargs = {"model": "smollm2-135m", "messages": _chat(), "max_tokens": 24, "logprobs": True, "top_logprobs": 2}
    res = client.chat.completions.create(**kwargs)
    content = res.choices[0].logprobs.content
    ref = api.generate(lm, QUESTION, max_tokens=24, logprobs=2)
    assert len(content) == len(ref.tokens) == res.usage.completion_tokens
    assert "".join(t.token for t in content) == res.choices[0].message.content
    for got, want in zip(content, ref.logprobs):
        assert got.token == lm.tokenizer.token_text(want.token) and abs(got.logprob - want.logprob) < 1e-4
        assert bytes(got.bytes) == lm.tokenizer.token_bytes(want.token)
        assert [t.token for t in got.top_logprobs] == [lm.tokenizer.token_text(i) for i, _ in want.top]
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]
    assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(streamed, content))  # a cached prefix rounds apart
    plain = client.chat.completions.create(model="smollm2-135m", messages=_chat(), max_tokens=24)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == res.choices[0].message.content


def test_completions_log_probabilities_list_the_chosen_and_the_likeliest_tokens(server, client):
    res = client.completions.create(model="smollm2-135m", prompt="1, 2, 3, 4, 5,", max_tokens=8, logprobs=2)
    lp = res.choices[0].logprobs
    assert "".join(lp.tokens) == res.choices[0].text and len(lp.token_logprobs) == 8
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == value <= 0 and 2 <= len(top) <= 3  # greedy: the chosen token is one of the two
    stopped = client.completions.create(model="smollm2-135m", prompt="1, 2, 3, 4, 5,", max_tokens=8, logprobs=0,
                                        stop=["8"])
    assert "8" not in stopped.choices[0].text and "8" in stopped.choices[0].logprobs.tokens  # the stop's tokens too
    r = httpx.post(f"{server}/v1/completions", json={"prompt": "hi", "logprobs": True}, timeout=60,
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs", r.text


def test_echo_scores_the_prompt_as_an_evaluation_harness_asks(client, lm):
    prompt = "The capital of France is Paris. The capital of Germany is"
    res = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=1, logprobs=1, echo=True)
    choice, lp = res.choices[0], res.choices[0].logprobs
    ids = lm.tokenizer.encode(prompt)
    assert choice.text.startswith(prompt) and "".join(lp.tokens) == choice.text and len(lp.tokens) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing comes before the first token
    ref = api.generate_batch(lm, [ids], max_tokens=1, logprobs=1)[0].logprobs[0]
    assert abs(lp.token_logprobs[-1] - ref.logprob) < 1e-4  # the answer's token as without echo
    assert all(v < 0 for v in lp.token_logprobs[1:])
    streamed = list(client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=1, logprobs=1,
                                              echo=True, stream=True))
    assert streamed[0].choices[0].text == prompt
    again = [v for c in streamed if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert again[0] is None and len(again) == len(lp.token_logprobs)
    assert all(abs(a - b) < 1e-4 for a, b in zip(again[1:], lp.token_logprobs[1:]))
    plain = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=1, echo=True)
    assert plain.choices[0].text == choice.text and plain.choices[0].logprobs is None
    as_ids = client.completions.create(model="smollm2-135m", prompt=ids, max_tokens=1, logprobs=1, echo=True)
    assert as_ids.choices[0].text == choice.text  # a prompt of token ids, as lm-evaluation-harness sends one
    assert all(abs(a - b) < 1e-4 for a, b in zip(as_ids.choices[0].logprobs.token_logprobs[1:], lp.token_logprobs[1:]))
    for bad in ([[1, 2], []], [1, 2.5], [49152], [-1], [], ["x", 5], [[1], [49152]]):
        r = httpx.post(f"{client.base_url}completions", json={"prompt": bad}, timeout=60,
                       headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", (bad, r.text)


def test_n_choices_per_prompt_and_several_prompts_per_request(client, lm):
    one = client.chat.completions.create(model="smollm2-135m", messages=_chat(), max_tokens=16)
    res = client.chat.completions.create(model="smollm2-135m", messages=_chat(), max_tokens=16, n=3)
    assert [c.index for c in res.choices] == [0, 1, 2]
    assert {c.message.content for c in res.choices} == {one.choices[0].message.content}  # greedy: the same answer
    assert res.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counts once
    assert res.usage.completion_tokens == 3 * one.usage.completion_tokens
    story = {"model": "smollm2-135m", "messages": _chat("Tell me a story."), "max_tokens": 16, "temperature": 0.9}
    sampled = client.chat.completions.create(**story, n=2, seed=3).choices
    alone = [client.chat.completions.create(**story, seed=seed).choices[0].message.content for seed in (3, 4)]
    assert [c.message.content for c in sampled] == alone and alone[0] != alone[1]  # choice k draws from seed + k
    prompts = ["1, 2, 3, 4, 5,", "The capital of France is"]
    batch = client.completions.create(model="smollm2-135m", prompt=prompts, max_tokens=8, n=2)
    want = [client.completions.create(model="smollm2-135m", prompt=p, max_tokens=8).choices[0].text for p in prompts]
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text for c in batch.choices] == [want[0], want[0], want[1], want[1]]  # choice i answers prompt i // n
    streamed = list(client.completions.create(model="smollm2-135m", prompt=prompts, max_tokens=8, stream=True,
                                              stream_options={"include_usage": True}))
    texts, finished = ["", ""], [None, None]
    for c in streamed:
        for ch in c.choices:
            texts[ch.index] += ch.text
            finished[ch.index] = ch.finish_reason or finished[ch.index]
    assert texts == want and None not in finished
    assert streamed[-1].usage.completion_tokens == 16 and not streamed[-1].choices


def test_a_follow_up_reuses_the_conversation_cache(client):
    first = client.chat.completions.create(model="smollm2-135m", messages=_chat(), max_tokens=16)
    follow = _chat() + [{"role": "assistant", "content": first.choices[0].message.content},
                        {"role": "user", "content": "And three secondary colors?"}]
    res = client.chat.completions.create(model="smollm2-135m", messages=follow, max_tokens=16)
    assert res.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens // 2


def test_concurrent_requests_each_get_their_own_answer(client, lm):
    questions = [QUESTION, "What is the capital of France?", "Count from one to five.", "Say hello."]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda q: client.chat.completions.create(
            model="smollm2-135m", messages=_chat(q), max_tokens=24).choices[0].message.content, questions))
    assert got == [api.generate(lm, q, max_tokens=24).text for q in questions]


def test_a_client_that_disconnects_stops_its_request(server, client):
    body = {"model": "smollm2-135m", "messages": _chat("Write a long story about a dragon."), "max_tokens": 400,
            "stream": True}
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
    assert any(line.startswith("data: ") for line in got)
    for _ in range(60):
        if httpx.get(f"{server}/health").json()["active"] == 0:
            break
        time.sleep(0.5)
    assert httpx.get(f"{server}/health").json()["active"] == 0
    assert client.chat.completions.create(model="smollm2-135m", messages=_chat(), max_tokens=4).choices


def test_a_non_streaming_client_that_disconnects_stops_its_request(server):
    body = {"model": "smollm2-135m", "prompt": "1, 2, 3, 4, 5,", "max_tokens": 4000}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server}/v1/completions", json=body, timeout=1.5, headers={"Authorization": f"Bearer {KEY}"})
    for _ in range(20):  # the request stops within a poll of its client (0.25 s) and a turn
        if httpx.get(f"{server}/health").json()["active"] == 0:
            break
        time.sleep(0.25)
    assert httpx.get(f"{server}/health").json()["active"] == 0


def test_null_fields_count_as_absent_and_developer_is_system(server):
    body = {"messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi."}],
            "n": None, "max_completion_tokens": None, "max_tokens": 2}
    r = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text
    assert 1 <= r.json()["usage"]["completion_tokens"] <= 2


HI = [{"role": "user", "content": "hi"}]
BAD = [  # body, status, a needle of the message, the error's param (where it names one)
    ("not json", 400, "not valid JSON", None),
    ("[" * 100000 + "]" * 100000, 400, "nested too deeply", None),
    ({"model": "gpt-17", "messages": HI}, 404, "not served here", "model"),
    ({"messages": HI, "n": 0}, 400, "'n' must be an integer from 1 to 128", "n"),
    ({"messages": HI, "n": True}, 400, "'n' must be an integer", "n"),
    ({"messages": HI, "n": 20}, 400, "asks for 20 completions but this server holds at most 19", "n"),
    ({"messages": HI, "temperature": "hot"}, 400, "temperature must be", "temperature"),
    ({"messages": HI, "temperature": -1}, 400, "temperature must be", "temperature"),
    ({"messages": HI, "temperature": 3.5}, 400, "temperature must be from 0 to 2", "temperature"),
    ({"messages": HI, "temperature": 1e300}, 400, "temperature must be from 0 to 2", "temperature"),
    ({"messages": HI, "max_tokens": 0}, 400, "max_tokens must be", "max_tokens"),
    ({"messages": HI, "max_tokens": 20000}, 400, "at most", "max_tokens"),
    ({"messages": HI, "max_tokens": 2147483648}, 400, "context is 8192", "max_tokens"),
    ({"messages": HI, "max_completion_tokens": 20000}, 400, "max_completion_tokens is 20000",
     "max_completion_tokens"),
    ({"messages": HI, "beam_width": 100000}, 400, "beam_width must be", "beam_width"),
    ({"messages": HI, "drafter_vocab": -1}, 400, "drafter_vocab must be", "drafter_vocab"),
    ({"messages": HI, "draft_confidence": 1.5}, 400, "draft_confidence must be", "draft_confidence"),
    ({"messages": HI, "draft_confidence": "high"}, 400, "draft_confidence must be", "draft_confidence"),
    ({"messages": HI, "draft": "warp"}, 400, "draft must be one of", "draft"),
    ({"messages": HI, "medusa_tree": 5}, 400, "'medusa_tree' must be a string", "medusa_tree"),
    ({"messages": HI, "medusa_tree": [1]}, 400, "'medusa_tree' must be a string", "medusa_tree"),
    ({"messages": HI, "medusa_tree": "oak"}, 400, "medusa_tree: unknown Medusa tree", "medusa_tree"),
    ({"messages": HI, "accept": "bogus"}, 400, "accept must be", "accept"),
    ({"messages": HI, "typical_eps": 5}, 400, "typical_eps must be", "typical_eps"),
    ({"messages": HI, "typical_delta": -1}, 400, "typical_delta must be", "typical_delta"),
    ({"messages": HI, "seed": -5}, 400, "seed", "seed"),
    ({"messages": HI, "stop": ["a", "b", "c", "d", "e"]}, 400, "'stop'", "stop"),
    ({"messages": HI, "tools": [{"type": "function"}]}, 400, "tools[0] must be", "tools"),
    ({"messages": HI, "tools": [WEATHER], "tool_choice": "sometimes"}, 400, "tool_choice must be", "tool_choice"),
    ({"messages": HI, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}}, 400,
     "one of get_weather", "tool_choice"),
    ({"messages": HI, "tool_choice": "required"}, 400, "has no 'tools'", "tool_choice"),
    ({"messages": HI, "tools": [WEATHER], "parallel_tool_calls": "yes"}, 400, "must be true or false",
     "parallel_tool_calls"),
    ({"messages": HI, "prediction": "Hello"}, 400, "'prediction' must be", "prediction"),
    ({"messages": HI, "prediction": {"type": "content", "content": [{"type": "image"}]}}, 400, "\"text\": ...} parts",
     "prediction"),
    ({"messages": HI, "tools": [WEATHER, WEATHER]}, 400, "same name", "tools"),
    ({"messages": HI, "tools": [WEATHER], "response_format": {"type": "json_object"}}, 400, "not both",
     "response_format"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "1"}]}]}, 400, "every call must be", "messages"),
    ({"messages": HI, "response_format": {"type": "xml"}}, 400, "response_format must be", "response_format"),
    ({"messages": HI, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400,
     "needs \"json_schema\"", "response_format"),
    ({"messages": HI, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objec"}}}},
     400, "the schema is not usable", "response_format"),
    ({"messages": HI, "logit_bias": {"five": 1}}, 400, "token id 'five' is not an integer", "logit_bias"),
    ({"messages": HI, "logit_bias": {"5": 500}}, 400, "from -100 to 100", "logit_bias"),
    ({"messages": HI, "logit_bias": [5, -100]}, 400, "not an (id, bias) pair", "logit_bias"),
    ({"messages": HI, "logit_bias": {"49152": 1}}, 400, "outside the model's vocabulary", None),
    ({"messages": HI, "presence_penalty": 2.5}, 400, "presence_penalty must be a finite number from -2 to 2",
     "presence_penalty"),
    ({"messages": HI, "repetition_context_size": 0}, 400, "repetition_context_size must be an integer",
     "repetition_context_size"),
    ({"messages": HI, "logprobs": 3}, 400, "'logprobs' must be true or false", "logprobs"),
    ({"messages": HI, "echo": True}, 400, "'echo' is a field of /v1/completions", "echo"),
    ({"messages": HI, "top_logprobs": 3}, 400, "needs 'logprobs': true", "top_logprobs"),
    ({"messages": HI, "logprobs": True, "top_logprobs": 21}, 400, "from 0 to 20", "top_logprobs"),
    ({"messages": []}, 400, "messages", "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "role", "messages"),
    ({"messages": [{"role": "user", "content": "\ud800"}]}, 400, "messages[0].content is not valid", "messages"),
    ({"messages": [{"role": "user", "content": "word " * 9000}]}, 400, "context", "messages"),
    ({"messages": [{"role": "user", "content": "x" * (1 << 20)}]}, 413, "larger than", None),
]


@pytest.mark.parametrize("body,status,needle,param", BAD, ids=[f"{i}-{b[1]}" for i, b in enumerate(BAD)])
def test_bad_requests_get_a_json_error_and_the_server_goes_on(server, body, status, needle, param):
    data = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(f"{server}/v1/chat/completions", content=data, timeout=60,
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"] and "Traceback" not in r.text
    assert "--" not in err["message"] and (param is None or err["param"] == param), err  # request fields, not flags
    assert httpx.get(f"{server}/health").json()["status"] == "ok"


def test_the_capacity_is_max_active_running_plus_max_queued_waiting(lm):
    loop = asyncio.new_event_loop()
    try:
        for active, queued in ((1, 0), (2, 1)):
            scheduler = Scheduler(lm, max_active=active, max_queued=queued)  # not started: jobs stay queued
            for _ in range(active + queued):
                scheduler.submit(Job([1, 2], DecodeOptions(max_tokens=4), [], loop))
            with pytest.raises(ApiError) as e:
                scheduler.submit(Job([1, 2], DecodeOptions(max_tokens=4), [], loop))
            assert e.value.status == 429
    finally:
        loop.close()


def test_metrics_count_a_completion_whose_client_left_before_it_started(lm):
    async def run() -> str:
        scheduler = Scheduler(lm, max_active=1, max_queued=2)
        loop = asyncio.get_running_loop()
        left, kept = (Job([1, 2, 3], DecodeOptions(max_tokens=3), [], loop) for _ in range(2))
        left.cancel()
        scheduler.submit(left, kept)
        scheduler.start()
        try:
            while (await asyncio.wait_for(kept.queue.get(), 120)).kind != "done":
                pass
            return scheduler.metrics.render(0, 0)
        finally:
            scheduler.stop()

    text = asyncio.run(run())
    assert 'redrafter_completions_total{finish_reason="abort"} 1' in text
    assert 'redrafter_completions_total{finish_reason="length"} 1' in text
    assert "redrafter_prompt_tokens_total 3" in text and "redrafter_generation_tokens_total 3" in text


def test_serve_on_a_port_in_use_fails_at_once_with_one_line(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "mlx_redrafter.cmd.main", "serve", "--port", str(port)],
                           capture_output=True, text=True, timeout=120, env=_env(tmp_path), stdin=subprocess.DEVNULL)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "in use" in lines[0], r.stderr
    assert "Traceback" not in r.stderr + r.stdout


def test_routes_and_keys(server):
    assert httpx.get(f"{server}/v1/nothing", headers={"Authorization": f"Bearer {KEY}"}).status_code == 404
    assert httpx.get(f"{server}/v1/models", headers={"Authorization": f"bearer {KEY}"}).status_code == 200
    assert httpx.get(f"{server}/v1/models", headers={"Authorization": f"Bearer {KEY}x"}).status_code == 401
    one = httpx.get(f"{server}/v1/models/smollm2-135m", headers={"Authorization": f"Bearer {KEY}"})
    assert one.status_code == 200 and one.json()["id"] == "smollm2-135m"
    other = httpx.get(f"{server}/v1/models/gpt-17", headers={"Authorization": f"Bearer {KEY}"})
    assert other.status_code == 404 and other.json()["error"]["type"] == "not_found_error"
    r = httpx.post(f"{server}/v1/chat/completions", json={"messages": _chat()})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    page = httpx.get(f"{server}/")
    assert page.status_code == 200 and "Token origin" in page.text and "/v1/chat/completions" in page.text


def _metrics(server: str) -> dict[str, float]:
    """GET /metrics as {sample name with its labels: value}."""
    res = httpx.get(f"{server}/metrics", headers={"Authorization": f"Bearer {KEY}"})
    assert res.status_code == 200 and res.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples = {}
    for line in res.text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def _idle_metrics(server: str) -> dict[str, float]:
    """The metrics once no completion runs or waits (an earlier test's abandoned stream ends at the next call)."""
    for _ in range(300):
        m = _metrics(server)
        if m["redrafter_completions_running"] == 0 and m["redrafter_completions_waiting"] == 0:
            return m
        time.sleep(0.1)
    raise AssertionError(f"the server never went idle: {m}")


def test_metrics_count_what_a_completion_did(server, client):
    before = _idle_metrics(server)
    res = client.chat.completions.create(
        model="smollm2-135m", max_tokens=32,
        messages=_chat("Copy this text exactly: the quick brown fox jumps over the lazy dog, twice."))
    after = _idle_metrics(server)

    def grew(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    tokens = res.usage.completion_tokens
    assert grew("redrafter_generation_tokens_total") == tokens
    assert grew("redrafter_prompt_tokens_total") == res.usage.prompt_tokens
    assert grew(f'redrafter_completions_total{{finish_reason="{res.choices[0].finish_reason}"}}') == 1
    steps = grew("redrafter_completion_steps_total")
    accepted = sum(grew(k) for k in after if k.startswith("redrafter_accepted_draft_tokens_total{"))
    assert 1 <= steps <= tokens - 1 <= steps + accepted  # each call: the drafts it accepted and its own token
    assert accepted > 0  # the copy was drafted
    assert grew("redrafter_target_calls_total") == steps  # alone in the batch: one call a step
    assert grew("redrafter_verified_tokens_total") >= steps + accepted
    assert grew("redrafter_time_to_first_token_seconds_count") == grew("redrafter_completion_seconds_count") == 1
    assert after['redrafter_completion_seconds_bucket{le="+Inf"}'] == after["redrafter_completion_seconds_count"]
    assert httpx.get(f"{server}/metrics").status_code == 401  # an --api-key guards it


def test_a_predicted_output_speeds_the_answer_it_predicts_and_changes_nothing(client):
    kwargs = {"model": "smollm2-135m", "messages": _chat("Write a short story about a robot."), "max_tokens": 64}
    plain = client.chat.completions.create(**kwargs)
    text = plain.choices[0].message.content
    assert plain.usage.completion_tokens_details.accepted_prediction_tokens == 0
    for prediction in ({"type": "content", "content": text},
                       {"type": "content", "content": [{"type": "text", "text": text[:20]}, {"type": "text",
                                                                                        "text": text[20:]}]}):
        res = client.chat.completions.create(**kwargs, prediction=prediction)
        assert res.choices[0].message.content == text
        details = res.usage.completion_tokens_details
        assert details.accepted_prediction_tokens >= res.usage.completion_tokens // 2
        assert res.usage.model_extra["redrafter"]["target_calls"] < plain.usage.model_extra["redrafter"]["target_calls"]

def test_tokenize_counts_what_the_completion_routes_prefill_and_detokenize_inverts_it(server, client, lm):
    auth = {"Authorization": f"Bearer {KEY}"}
    tok = lm.tokenizer
    chat = httpx.post(f"{server}/tokenize", json={"model": "smollm2-135m", "messages": _chat()}, headers=auth).json()
    assert chat["tokens"] == tok.encode_chat(_chat()) and chat["count"] == len(chat["tokens"])
    assert chat["max_model_len"] == lm.target.model.args.max_position_embeddings
    used = client.chat.completions.create(model="smollm2-135m", messages=_chat(), max_tokens=1).usage
    assert used.prompt_tokens == chat["count"]
    text = httpx.post(f"{server}/tokenize", json={"prompt": "Hello there", "return_token_strs": True},
                      headers=auth).json()
    assert text["tokens"] == tok.encode("Hello there") and len(text["token_strs"]) == text["count"]
    back = httpx.post(f"{server}/detokenize", json={"tokens": text["tokens"]}, headers=auth).json()
    assert back == {"prompt": "Hello there"}
    for route, body, param in [("tokenize", {}, "prompt"), ("tokenize", {"prompt": "a", "messages": _chat()}, "prompt"),
                               ("tokenize", {"prompt": 3}, "prompt"), ("detokenize", {"tokens": "1 2"}, "tokens"),
                               ("detokenize", {"tokens": [10 ** 9]}, "tokens"), ("detokenize", {"tokens": [True]},
                                                                                 "tokens")]:
        r = httpx.post(f"{server}/{route}", json=body, headers=auth)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (route, body, r.text)
    assert httpx.post(f"{server}/tokenize", json={"prompt": "a", "model": "gpt-17"}, headers=auth).status_code == 404
    assert httpx.post(f"{server}/tokenize", json={"prompt": "a"}).status_code == 401

CHROMIUM, CHROMEDRIVER = shutil.which("chromium") or shutil.which("chromium-browser"), shutil.which("chromedriver")


@pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER), reason="no chromium + chromedriver here (make test installs "
                    "Debian's where apt-get is available)")
def test_the_page_streams_an_answer_with_token_origins(server, tmp_path):
    """A real headless browser: send a message, see the answer stream in with its tokens marked by origin."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1100,900"):
        options.add_argument(arg)
    browser = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        browser.get(server + "/")
        browser.find_element(By.ID, "key").send_keys(KEY)
        browser.find_element(By.ID, "msg").send_keys("Repeat after me: red green blue, red green blue.")
        browser.find_element(By.ID, "send").click()
        WebDriverWait(browser, 120).until(lambda b: "tokens per target call" in b.find_element(By.ID, "stats").text)
        spans = browser.find_elements(By.CSS_SELECTOR, "#log .answer span")
        assert spans and {s.get_attribute("class") for s in spans} >= {"target"}
        assert any(s.get_attribute("class").startswith("draft-") for s in spans)
        browser.save_screenshot(str(os.environ.get("PAGE_SCREENSHOT", tmp_path / "page.png")))
    finally:
        browser.quit()


def test_the_endpoint_source_stores_a_real_servers_greedy_answers(server, lm, tmp_path):
    """`distill --endpoint`: this project's own server on localhost answers; every stored response is the text
    the same model decodes greedily (the library's), as token ids, with eos where the answer ended by itself."""
    from mlx_redrafter.train.corpus import load_shard
    from mlx_redrafter.train.distill import grow
    from mlx_redrafter.train.endpoint import EndpointSource
    from mlx_redrafter.train.plan import Settings

    prompts = ["Name three primary colors.", "What is 7 times 8?", "Say hello in French."]
    file = tmp_path / "prompts.jsonl"
    file.write_text("".join(json.dumps({"prompt": p, "source": "test"}) + "\n" for p in prompts))
    settings = Settings(max_new_tokens=16, shard_size=2, heldout=1)
    src = EndpointSource(lm.target, f"{server}/v1", file, settings, api_key=KEY, concurrency=2)
    corpus = grow(src, lm.target, tmp_path / "c", progress=False, log=lambda m: None)
    tok, stored = lm.target.tokenizer, 0
    for name in sorted(corpus.entries):
        sh = load_shard(corpus.root / name)
        for k in range(sh.num_sequences):
            ids = sh.tokens[sh.offsets[k]:sh.offsets[k + 1]].tolist()
            plen = int(sh.prompt_len[k])
            prompt = prompts[src.order[int(sh.prompt_index[k])]]
            assert ids[:plen] == tok.encode_chat([{"role": "user", "content": prompt}])
            res = api.generate(lm, prompt, max_tokens=16)
            ended = res.stats.stop_reason == "eos"
            assert ids[plen:] == tok.encode(res.text)[:16] + (tok.eos_ids[:1] if ended else [])
            stored += 1
    assert stored == len(prompts)
    assert corpus.manifest["source"] == "endpoint"


def test_an_endpoint_answer_without_content_skips_its_prompt(target, tmp_path):
    """A server that answers `content: null` (a refusal, a tool call) for one prompt: that prompt is counted as
    skipped, never stored as an empty answer."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from mlx_redrafter.train.distill import grow
    from mlx_redrafter.train.endpoint import EndpointSource
    from mlx_redrafter.train.plan import Settings

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            text = None if "French" in body["messages"][0]["content"] else "Fifty-six."
            data = json.dumps({"choices": [{"message": {"content": text}, "finish_reason": "stop"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    remote = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=remote.serve_forever, daemon=True).start()
    try:
        file = tmp_path / "prompts.jsonl"
        file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["What is 7 times 8?", "Hello in French?"]))
        src = EndpointSource(target, f"http://127.0.0.1:{remote.server_address[1]}/v1", file,
                             Settings(max_new_tokens=16, shard_size=1, heldout=1))
        corpus = grow(src, target, tmp_path / "c", progress=False, log=lambda m: None)
    finally:
        remote.shutdown()
    entries = corpus.entries.values()
    assert sum(e["sequences"] for e in entries) == 1 and sum(e["skipped_prompts"] for e in entries) == 1


def test_a_text_response_format_lifts_the_servers_default_schema():
    from mlx_redrafter.server import protocol

    base = DecodeOptions().updated(json_schema={"type": "object"})
    body = {"messages": _chat()}
    assert protocol.parse(body, "chat", "m", base).options.json_schema == base.json_schema
    text = protocol.parse({**body, "response_format": {"type": "text"}}, "chat", "m", base)
    assert text.options.json_schema is None
    tools = protocol.parse({**body, "tools": [WEATHER]}, "chat", "m", base)
    assert "tool_call" in tools.options.json_schema


@pytest.mark.parametrize("answer", [
    {"tool_call": {"name": "get_weather", "arguments": {"city": 'Par"is {x}', "n": [1, {"a": "]"}], "u": "é\\"}}},
    {"tool_calls": [{"name": "a", "arguments": {"x": 1}}, {"name": "b-2", "arguments": {}},
                    {"name": "c", "arguments": {"s": "\u2028 , }"}}]},
    {"tool_call": {"name": "s", "arguments": 5}},
    {"tool_call": {"name": "s", "arguments": "str,}"}},
])
def test_tool_calls_stream_their_arguments_whatever_pieces_the_answer_arrives_in(answer):
    from mlx_redrafter.server.tools import CallStream

    calls = answer.get("tool_calls") or [answer["tool_call"]]
    for ascii_only in (False, True):
        raw = json.dumps(answer, ensure_ascii=ascii_only)
        for size in (1, 2, 3, 7, len(raw)):
            stream, names, arguments = CallStream(), {}, {}
            for k in range(0, len(raw), size):
                for piece in stream.feed(raw[k : k + size]):
                    if piece.name is not None:  # a call's first piece names it, once
                        assert piece.index not in names and piece.id.startswith("call_")
                        names[piece.index] = piece.name
                    arguments[piece.index] = arguments.get(piece.index, "") + piece.arguments
            assert [names[i] for i in sorted(names)] == [c["name"] for c in calls]
            assert [json.loads(arguments[i]) for i in sorted(arguments)] == [c["arguments"] for c in calls]
    assert CallStream().feed(json.dumps({"response": '{"name": "x", "arguments": 1}'})) == []  # a direct answer


def test_a_lone_surrogate_in_a_tool_answer_becomes_a_replacement_character():
    """JSON lets a string escape half a surrogate pair (\\ud800), which UTF-8 cannot encode: a whole answer's
    message (a call's arguments, a direct answer) holds U+FFFD there, as a streamed one does."""
    from mlx_redrafter.server.tools import Reply, Tools

    tools = Tools([WEATHER["function"]], "auto")
    call, finish = tools.message('{"tool_call": {"name": "get_weather", "arguments": {"city": "a\\ud800b"}}}')
    assert finish == "tool_calls" and json.loads(call["tool_calls"][0]["function"]["arguments"]) == {"city": "a\ufffdb"}
    answer, _ = tools.message('{"response": "x\\udc00y \\ud83d\\ude00"}')
    assert answer["content"] == "x\ufffdy \U0001f600"
    json.dumps(call, ensure_ascii=False).encode("utf-8")  # both can be written
    json.dumps(answer, ensure_ascii=False).encode("utf-8")
    reply = Reply()
    reply.feed('{"response": "x\\udc00y \\ud83d\\ude00"}')
    assert reply.text == answer["content"]


@pytest.mark.parametrize("text", ["plain", 'a "quote", a \\ and\na line\tand tab', "é ü 😀 \u2028", ""])
def test_a_reply_decodes_its_json_string_whatever_pieces_it_arrives_in(text):
    from mlx_redrafter.server.tools import Reply

    for ascii_only in (False, True):
        raw = json.dumps({"response": text}, ensure_ascii=ascii_only)
        for size in (1, 2, 3, 5):
            reply = Reply()
            got = "".join(reply.feed(raw[k : k + size]) for k in range(0, len(raw), size))
            assert got == reply.text == text and reply.ended
    cut = Reply()
    cut.feed('{"response": "caf\\u00')  # an escape cut by max_tokens waits for its rest
    assert cut.text == "caf" and not cut.ended
    assert Reply().feed('{"tool_call": {"name": "x"') == ""
