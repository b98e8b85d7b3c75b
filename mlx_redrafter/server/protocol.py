"""The OpenAI wire format: requests parsed and checked into what the scheduler runs, responses and errors built.

Decoding fields are checked by the option groups the CLI uses (`DecodeOptions.updated` + `check`): a bad value is
the same one-line message, here as a 400 JSON error naming the field.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from mlx_redrafter.constraint import response_format, schema_text
from mlx_redrafter.errors import UserError
from mlx_redrafter.logprobs import MAX_TOP_LOGPROBS, TokenLogprob
from mlx_redrafter.models.tokenizer import TextTokenizer
from mlx_redrafter.options import DecodeOptions
from mlx_redrafter.schema import shown
from mlx_redrafter.server.tools import Tools, parse_tools

# Request fields that select how to decode, by their flat option names (draft modes, shapes, sampling).
DECODE_FIELDS = ("draft", "beam_width", "beam_length", "lookup_width", "lookup", "lookup_max_length",
                 "answers_width", "drafter_vocab", "draft_confidence", "medusa_tree", "temperature", "top_p",
                 "top_k", "min_p", "seed", "accept", "typical_eps", "typical_delta", "logit_bias",
                 "repetition_penalty", "repetition_context_size", "presence_penalty", "presence_context_size",
                 "frequency_penalty", "frequency_context_size")
TEXT_FIELDS = ("draft", "lookup", "medusa_tree", "accept")  # decoding fields that take a string
MAX_TEMPERATURE = 2.0  # OpenAI's upper bound (the CLI allows more)
# Fields this server does not serve -> the value that means "not used".
UNSUPPORTED = {"functions": None, "suffix": None, "best_of": 1}
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
MAX_STOPS = 4
MAX_N = 128  # completions per prompt (OpenAI's bound)


class ApiError(Exception):
    """An error with its HTTP status, as OpenAI's JSON error object."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.headers = status, message, param, kind, headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


@dataclass
class Request:
    """One completion to run: chat messages or a raw prompt, checked options, stop strings, how to answer."""

    kind: str  # chat | text
    model: str
    messages: list[dict[str, Any]] = field(default_factory=list)  # checked (`_messages`), tool calls included
    tools: Tools | None = None  # functions the answer may or must call (server/tools.py)
    prompts: list[str] = field(default_factory=list)  # completions: the prompts' texts (a batch of one or more)
    prompt_ids: list[list[int] | None] = field(default_factory=list)  # per prompt: its token ids, if given as ids
    n: int = 1  # completions per prompt; choice i answers prompt i // n
    options: DecodeOptions = field(default_factory=DecodeOptions)
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    echo: bool = False  # completions: the answer's text (and log-probabilities) start with the prompt's
    max_tokens_field: str | None = None  # the request field that set options.max_tokens (None: the default)
    prediction_tokens: int = 0  # tokens of the predicted output (`prediction`), for usage
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


def _text(value: str, where: str, param: str) -> str:
    """`value`, unless it holds what UTF-8 cannot encode (a lone surrogate from a JSON \\ud800 escape)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise _bad(f"{where} is not valid Unicode text (it holds a lone surrogate)", param) from None
    return value


def parse(body: Any, kind: str, served: str, base: DecodeOptions) -> Request:
    """Check a /v1/chat/completions (kind 'chat') or /v1/completions ('text') body against what this server
    serves; `base` holds the server's own decoding defaults. Raises ApiError."""
    _check_body(body, served)
    for name, unused in UNSUPPORTED.items():
        if name in body and body[name] not in (unused, None):
            raise _bad(f"{name!r} is not supported by this server", name)
    req = Request(kind=kind, model=served, n=_n(body.get("n")))
    if kind == "chat":
        req.messages = _messages(body.get("messages"))
    else:
        req.prompts, req.prompt_ids = _prompts(body.get("prompt"))
    req.stop = _stop(body.get("stop"))
    req.stream = _bool(body, "stream", False)
    req.echo = _bool(body, "echo", False)
    if req.echo and kind == "chat":
        raise _bad("'echo' is a field of /v1/completions, not of chat completions", "echo")
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise _bad("'stream_options' must be an object", "stream_options")
        req.include_usage = _bool(opts, "include_usage", False)
    req.options, req.max_tokens_field = _options(body, base)
    req.options = req.options.updated(logprobs=_logprobs(body, kind))
    schema = _json_schema(body.get("response_format"))
    if kind == "chat":
        req.tools = _tools(body)
        if req.tools is not None:
            if schema is not None:
                raise _bad("give 'tools' or a JSON 'response_format', not both", "response_format")
            schema = schema_text(req.tools.schema())
    elif body.get("tools") is not None:
        raise _bad("'tools' is a field of chat completions, not of /v1/completions", "tools")
    if schema is not None:
        req.options = _checked(req.options, {"json_schema": schema}, "response_format",
                               {"json_schema": "response_format"})
    elif body.get("response_format") is not None:  # {"type": "text"} asks for free text, whatever serve's default
        req.options = replace(req.options, json_schema=None)
    prediction = _prediction(body.get("prediction"))
    if prediction:
        req.options = req.options.updated(prediction=prediction)
    return req


def _prediction(value: Any) -> str | None:
    """The text of OpenAI's predicted output (`{"type": "content", "content": text or text parts}`)."""
    if value is None:
        return None
    content = value.get("content") if isinstance(value, dict) and value.get("type") == "content" else None
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise _bad("'prediction' must be {\"type\": \"content\", \"content\": text or a list of {\"type\": "
                   "\"text\", \"text\": ...} parts}", "prediction")
    return _text(content, "'prediction'", "prediction")


def _check_body(body: Any, served: str) -> None:
    """A 400 unless the body is a JSON object, a 404 if its `model` is not the one served here."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    model = body.get("model", served)
    if not isinstance(model, str):
        raise _bad("'model' must be a string", "model")
    if model not in (served, "default"):
        raise ApiError(404, f"model {shown(model)} is not served here; this server serves {served!r}", "model",
                       "not_found_error")


def _tools(body: dict) -> Tools | None:
    try:
        return parse_tools(body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls"))
    except UserError as e:
        raise _bad(str(e), next((f for f in ("tool_choice", "parallel_tool_calls") if f in str(e)), "tools")) from None


@dataclass
class TokenizeRequest:
    """What /tokenize counts: a chat (as a chat completion's prompt) or raw text (as a completion's)."""

    messages: list[dict[str, Any]] | None
    tools: Tools | None
    prompt: str | None
    token_strs: bool


def parse_tokenize(body: Any, served: str) -> TokenizeRequest:
    """Check a /tokenize body (vLLM's: `prompt` or `messages`, with `tools`, `return_token_strs`)."""
    _check_body(body, served)
    has_messages, has_prompt = body.get("messages") is not None, body.get("prompt") is not None
    if has_messages == has_prompt:
        raise _bad("give 'prompt' (text, tokenized as /v1/completions does) or 'messages' (a chat, tokenized as "
                   "/v1/chat/completions does), one of the two", "prompt")
    strs = _bool(body, "return_token_strs", False)
    if has_messages:
        return TokenizeRequest(_messages(body["messages"]), _tools(body), None, strs)
    if not isinstance(body["prompt"], str):
        raise _bad("'prompt' must be a string", "prompt")
    return TokenizeRequest(None, None, _text(body["prompt"], "'prompt'", "prompt"), strs)


def parse_detokenize(body: Any, served: str) -> list[int]:
    """The token ids of a /detokenize body (`tokens`; checked against the model by the caller)."""
    _check_body(body, served)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise _bad("'tokens' must be a list of token ids (integers)", "tokens")
    return tokens


def _json_schema(value: Any) -> str | None:
    """The JSON schema OpenAI's `response_format` asks the answer to follow (None: plain text)."""
    try:
        return response_format(value)
    except UserError as e:
        raise _bad(str(e), "response_format") from None


def _logprobs(body: dict, kind: str) -> int | None:
    """How many alternatives per token the answer lists with the tokens' log-probabilities (None: no
    log-probabilities): chat's `logprobs` (true/false) and `top_logprobs`, or the completions' `logprobs` (a count)."""
    def count(name: str) -> int:
        value = body[name]
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOP_LOGPROBS:
            raise _bad(f"'{name}' must be an integer from 0 to {MAX_TOP_LOGPROBS} (got {value!r})", name)
        return value

    if kind == "text":
        return None if body.get("logprobs") is None else count("logprobs")
    on = _bool(body, "logprobs", False)
    top = None if body.get("top_logprobs") is None else count("top_logprobs")
    if top is not None and not on:
        raise _bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if on else None


def _bool(d: dict, name: str, default: bool) -> bool:
    value = d.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(f"'{name}' must be true or false (got {value!r})", name)
    return value


def _messages(messages: Any) -> list[dict[str, Any]]:
    """Checked chat messages: {role, content}, an assistant's `tool_calls` ({name, arguments}) and a tool result's
    function `name` (found from its `tool_call_id`) where given."""
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list of {role, content} objects", "messages")
    out: list[dict[str, Any]] = []
    called: dict[str, str] = {}  # tool call id -> function name
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or m["role"] not in ROLES:
            raise _bad(f"messages[{i}] must be an object with a role of {', '.join(ROLES)}", "messages")
        role = ROLES[m["role"]]
        calls = _tool_calls(m.get("tool_calls"), i) if role == "assistant" else []
        content = m.get("content")
        if content is None and calls:
            content = ""
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise _bad(f"messages[{i}].content: every part must be {{\"type\": \"text\", \"text\": "
                           "a string}} (only text parts are supported)", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise _bad(f"messages[{i}].content must be a string", "messages")
        entry: dict[str, Any] = {"role": role, "content": _text(content, f"messages[{i}].content", "messages")}
        if calls:
            entry["tool_calls"] = calls
            called.update((c["id"], c["name"]) for c in calls)
        if role == "tool":
            entry["name"] = called.get(m.get("tool_call_id"), m.get("name") if isinstance(m.get("name"), str) else "")
        out.append(entry)
    if not any(m["content"].strip() or m.get("tool_calls") for m in out):
        raise _bad("the messages are empty", "messages")
    return out


def _tool_calls(calls: Any, i: int) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls` as {id, name, arguments} (arguments parsed where they are JSON)."""
    if calls is None:
        return []
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise _bad(f"{where} must be a list of {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                   "\"arguments\"}}}} objects", "messages")
    out = []
    for c in calls:
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not isinstance(f.get("arguments", ""), str):
            raise _bad(f"{where}: every call must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\": a "
                       "string, \"arguments\": a JSON string}}}}", "messages")
        try:
            arguments = json.loads(f.get("arguments") or "{}")
        except ValueError:
            arguments = f["arguments"]
        out.append({"id": str(c.get("id", "")), "name": f["name"], "arguments": arguments})
    return out


def _n(n: Any) -> int:
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise _bad(f"'n' must be an integer from 1 to {MAX_N} (got {n!r})", "n")
    return n


def _prompts(prompt: Any) -> tuple[list[str], list[list[int] | None]]:
    """A completions prompt, as OpenAI and vLLM take it: a string, a list of token ids, or a non-empty list of
    either (a batch of prompts). Returns each prompt's text ("" for ids) and ids (None for text); the ids are
    checked against the model by the caller."""
    many = prompt if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt) \
        else [prompt]
    texts: list[str] = []
    ids: list[list[int] | None] = []
    for i, p in enumerate(many):
        where = "'prompt'" if len(many) == 1 else f"prompt[{i}]"
        if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            texts.append("")
            ids.append(p)
            continue
        if not isinstance(p, str):
            raise _bad("'prompt' must be a string, a list of token ids, or a list of either", "prompt")
        if not p.strip():
            raise _bad("the prompt is empty" if len(many) == 1 else f"{where} is empty", "prompt")
        texts.append(_text(p, where, "prompt"))
        ids.append(None)
    return texts, ids


def _stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOPS:
        raise _bad(f"'stop' must be a non-empty string or a list of up to {MAX_STOPS} of them", "stop")
    return [_text(s, "'stop'", "stop") for s in stops]


def _options(body: dict, base: DecodeOptions) -> tuple[DecodeOptions, str | None]:
    """The decoding options a body asks for over `base`, and which field set max_tokens (None: none did).
    Each field is checked on its own, so an error names the field that is wrong."""
    flat = {k: body[k] for k in DECODE_FIELDS if body.get(k) is not None}
    limit_field = next((k for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None), None)
    if limit_field is not None:
        flat["max_tokens"] = body[limit_field]
    aliases = {"max_tokens": limit_field} if limit_field else {}
    for k, value in flat.items():
        if k in TEXT_FIELDS:
            if not isinstance(value, str):
                raise _bad(f"'{k}' must be a string (got {value!r})", k)
            _text(value, f"'{k}'", k)
        _checked(base, {k: value}, aliases.get(k, k), aliases)
    temperature = flat.get("temperature")
    if temperature is not None and temperature > MAX_TEMPERATURE:
        raise _bad(f"temperature must be from 0 to {MAX_TEMPERATURE:g} (got {temperature!r})", "temperature")
    return _checked(base, flat, None, aliases), limit_field


def _checked(base: DecodeOptions, flat: dict[str, Any], field: str | None, aliases: dict[str, str]) -> DecodeOptions:
    """`base` updated by `flat` and checked; a bad value is a 400 naming `field` (and the request's field names
    where the option groups name CLI flags)."""
    try:
        options = base.updated(**flat)
        options.check()
    except UserError as e:
        message = field_names(str(e), aliases)
        if field is not None and field not in message:
            message = f"{field}: {message}"
        raise _bad(message, field) from None
    return options


_FLAG = re.compile(r"--([a-z][a-z-]*)")
_FLAG_FIELDS = {"temp": "temperature"}  # CLI flags whose request field is not the flag's own name


def field_names(message: str, aliases: dict[str, str] | None = None) -> str:
    """An option group's message with its CLI flags (--temp, --drafter-vocab) as request fields; `aliases` renames
    a field (max_tokens given as max_completion_tokens)."""
    def field(m: re.Match) -> str:
        name = _FLAG_FIELDS.get(m.group(1), m.group(1).replace("-", "_"))
        return (aliases or {}).get(name, name)
    return _FLAG.sub(field, message)


@dataclass
class Ended:
    """How one choice ended, with what usage reports of it."""

    finish: str  # stop | length
    prompt_tokens: int
    completion_tokens: int
    cached: int  # prompt tokens continued from a cached conversation
    stats: Any  # generate.Stats
    draft: str


def usage(ended: list[Ended], n: int = 1, predicted: int = 0) -> dict[str, Any]:
    """OpenAI's usage object over a request's choices (`n` per prompt, a prompt counted once), with what
    speculation did under 'redrafter' (over all choices: a target call that decided for several counts for each);
    `predicted`: tokens of the request's predicted output, of which those the answers took are 'accepted'."""
    firsts = ended[::n]
    prompt_tokens = sum(e.prompt_tokens for e in firsts)
    completion_tokens = sum(e.completion_tokens for e in ended)
    steps = sum(e.stats.steps for e in ended)
    decided = sum(e.stats.decided_tokens for e in ended if e.stats.steps)
    runs: dict[str, float] = {}
    for e in ended:
        for source, v in e.stats.source_runs.items():
            runs[source] = runs.get(source, 0) + v
    decode_s = sum(e.stats.decode_s for e in ended)
    generated = sum(max(e.stats.generated_tokens - 1, 0) for e in ended)
    accepted = int(runs.get("prediction", 0))
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(e.cached for e in firsts)},
            "completion_tokens_details": {"accepted_prediction_tokens": accepted,
                                          "rejected_prediction_tokens": max(predicted * len(ended) - accepted, 0)},
            "redrafter": {"draft": ended[0].draft, "tokens_per_call": round(decided / steps, 4) if steps else 0.0,
                          "target_calls": steps,
                          "source_tokens_per_call": {k: round(1 + v / steps, 4) for k, v in runs.items()}
                          if steps else {},
                          "decode_tokens_per_s": round(generated / decode_s, 2) if decode_s > 0 else 0.0}}


def chunk(req: Request, text: str, finish: str | None = None, origin: dict | None = None,
          first: bool = False, logprobs: dict[str, Any] | None = None, index: int = 0,
          message: dict[str, Any] | None = None, calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """One streamed chunk of choice `index` (chat.completion.chunk or text_completion); `logprobs` from
    `Logprobs.wire`; `message`: a whole assistant message as the delta (`answer_message`); `calls`: pieces of tool
    calls as they stream (`tools.CallPiece.wire`)."""
    if req.kind == "chat":
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
        if finish is not None and not text:
            delta = {}
        if calls is not None:
            delta = {"role": "assistant", "content": None, "tool_calls": calls} if first else {"tool_calls": calls}
        if message is not None:
            delta = {**message, "tool_calls": [{"index": k, **c} for k, c in enumerate(message["tool_calls"])]} \
                if message.get("tool_calls") else message
        choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": finish}
        if logprobs is not None:
            choice["logprobs"] = logprobs
        obj = "chat.completion.chunk"
    else:
        choice, obj = {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}, "text_completion"
    out = {"id": _id(req), "object": obj, "created": req.created, "model": req.model, "choices": [choice]}
    if origin is not None:
        out["redrafter"] = origin
    return out


def answer_message(req: Request, text: str, finish: str) -> tuple[dict[str, Any], str]:
    """A chat answer's assistant message and finish reason: with tools, a tool call becomes `tool_calls`
    (finish_reason "tool_calls") and a direct answer its text (server/tools.py)."""
    if req.tools is None:
        return {"role": "assistant", "content": text}, finish
    message, reason = req.tools.message(text)
    return message, reason or finish


def choice(req: Request, index: int, text: str, finish: str, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One choice of a whole answer (not streamed); `logprobs` from `Logprobs.wire`."""
    if req.kind == "chat":
        message, finish = answer_message(req, text, finish)
        return {"index": index, "message": message, "finish_reason": finish, "logprobs": logprobs}
    return {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}


def completion(req: Request, choices: list[dict[str, Any]], use: dict[str, Any]) -> dict[str, Any]:
    """The whole answer (not streamed): its `choice`s and usage."""
    obj = "chat.completion" if req.kind == "chat" else "text_completion"
    return {"id": _id(req), "object": obj, "created": req.created, "model": req.model, "choices": choices,
            "usage": use}


COMPLETION_LOGPROBS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


def joined(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two consecutive completions' log-probability objects as one."""
    return {k: a[k] + b[k] for k in COMPLETION_LOGPROBS}


class Logprobs:
    """Tokens' log-probabilities in OpenAI's wire format: chat's `{"content": [{token, logprob, bytes,
    top_logprobs}]}`, or the completions' `{tokens, token_logprobs, top_logprobs, text_offset}` (each token's
    alternatives there: the chosen token and the most likely ones, as OpenAI lists them). Holds the running text
    offset of a streamed completion."""

    def __init__(self, req: Request, tokenizer: TextTokenizer):
        self.kind, self.tokenizer, self.offset = req.kind, tokenizer, 0

    def prompt(self, first: int, entries: list[TokenLogprob]) -> dict[str, Any]:
        """The completions' wire object of an echoed prompt: its `first` token (no log-probability: nothing comes
        before it) and the `entries` of the tokens after it."""
        head = self.tokenizer.token_text(first)
        rest = self.wire(entries) if entries else {k: [] for k in COMPLETION_LOGPROBS}
        self.offset += len(head)
        return {"tokens": [head, *rest["tokens"]], "token_logprobs": [None, *rest["token_logprobs"]],
                "top_logprobs": [None, *rest["top_logprobs"]],
                "text_offset": [0, *(o + len(head) for o in rest["text_offset"])]}

    def wire(self, entries: list[TokenLogprob]) -> dict[str, Any]:
        """The wire object of the next `entries` of the answer."""
        text = self.tokenizer.token_text
        if self.kind == "chat":
            def one(i: int, lp: float) -> dict[str, Any]:
                return {"token": text(i), "logprob": lp, "bytes": list(self.tokenizer.token_bytes(i))}
            return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(i, v) for i, v in e.top]}
                                for e in entries], "refusal": None}
        tokens = [text(e.token) for e in entries]
        offsets = []
        for t in tokens:
            offsets.append(self.offset)
            self.offset += len(t)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{text(e.token): e.logprob, **{text(i): v for i, v in e.top}} for e in entries],
                "text_offset": offsets}


def _id(req: Request) -> str:
    return ("chatcmpl-" if req.kind == "chat" else "cmpl-") + req.id
