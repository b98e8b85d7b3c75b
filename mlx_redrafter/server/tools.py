"""Function calling for any model: OpenAI's `tools` and `tool_choice`, answered in one JSON format the grammar
enforces (llama.cpp's generic tool format).

The tools are described to the model in the system message, and the answer is constrained (constraint.py) to
`{"tool_call": {"name": ..., "arguments": {...}}}` (the arguments follow that function's `parameters` schema), with
`parallel_tool_calls` to `{"tool_calls": [{"name": ..., "arguments": {...}}, ...]}` (one call or more), or, with
`tool_choice` "auto", to `{"response": "text"}`. The server turns the calls into the assistant message's
`tool_calls` (finish_reason "tool_calls") and a response into its `content`; streamed, both go out as the model
writes them (`Reply`, `CallStream`).
Earlier turns go back to the template in the same format: an assistant message's `tool_calls` as the JSON the model
wrote, a `tool` message (a result) as a user message holding `{"tool_response": {"name": ..., "content": ...}}`.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from mlx_redrafter.errors import UserError

NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
MAX_TOOLS = 128


@dataclass
class Tools:
    """The functions a request offers and which the answer may (auto) or must (required, or one named) call."""

    functions: list[dict[str, Any]]  # {"name", "description", "parameters"}
    choice: str  # auto | required | the name of the one function to call
    parallel: bool = False  # several calls in one answer (`parallel_tool_calls`)

    def schema(self) -> dict[str, Any]:
        """The JSON schema the answer follows."""
        def call(f: dict[str, Any]) -> dict[str, Any]:
            return {"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
                    "required": ["name", "arguments"], "additionalProperties": False}

        offered = {"anyOf": [call(f) for f in self.functions if self.choice in ("auto", "required", f["name"])]}
        key, value = ("tool_calls", {"type": "array", "items": offered, "minItems": 1}) if self.parallel \
            else ("tool_call", offered)
        calls = {"type": "object", "properties": {key: value}, "required": [key], "additionalProperties": False}
        if self.choice != "auto":
            return calls
        text = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
                "additionalProperties": False}
        return {"anyOf": [calls, text]}

    def system_text(self) -> str:
        """What the system message tells the model about the tools and the answer's format."""
        listed = json.dumps([{"name": f["name"], "description": f["description"], "parameters": f["parameters"]}
                             for f in self.functions], ensure_ascii=False)
        name = "<tool name>" if self.choice in ("auto", "required") else self.choice
        one = f'{{"name": "{name}", "arguments": {{...}}}}'
        form = f'{{"tool_calls": [{one}, ...]}}' if self.parallel else f'{{"tool_call": {one}}}'
        to_call = "To call tools" if self.parallel else "To call a tool"
        how = {"auto": f'{to_call}, answer {form}; to answer directly, answer {{"response": "<your answer>"}}.',
               "required": f"{to_call}, answer {form}."}
        return f"You can use these tools: {listed}\n" + how.get(self.choice, f"Call the tool {name}: answer {form}.")

    def message(self, text: str) -> tuple[dict[str, Any], str | None]:
        """The assistant message of an answer's text, and the finish reason it implies (None: the caller's)."""
        try:
            value = _text_only(json.loads(text))
        except ValueError:  # cut before the JSON ended (max_tokens): a response's text so far, or the text as is
            reply = Reply()
            reply.feed(text)
            return {"role": "assistant", "content": reply.text if reply.began else text}, None
        calls = value.get("tool_calls") if self.parallel and isinstance(value, dict) else \
            [value["tool_call"]] if isinstance(value, dict) and "tool_call" in value else None
        if isinstance(calls, list) and calls and all(isinstance(c, dict) for c in calls):
            return {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                "function": {"name": c.get("name"), "arguments": json.dumps(c.get("arguments"), ensure_ascii=False)}}
                for c in calls]}, "tool_calls"
        if isinstance(value, dict) and isinstance(value.get("response"), str):
            return {"role": "assistant", "content": value["response"]}, None
        return {"role": "assistant", "content": text}, None


LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # what json.loads leaves of a \ud800 escape without its pair


def _text_only(value: Any) -> Any:
    """`value` (parsed JSON) with every lone surrogate in its strings replaced by U+FFFD, as `Reply` does: UTF-8
    cannot encode one, so the HTTP answer could not be written."""
    if isinstance(value, str):
        return LONE_SURROGATE.sub("\ufffd", value)
    if isinstance(value, list):
        return [_text_only(v) for v in value]
    if isinstance(value, dict):
        return {_text_only(k): _text_only(v) for k, v in value.items()}
    return value


class Reply:
    """The text of a direct answer (`{"response": "..."}`) as it arrives, decoded from its JSON string, so that it
    streams as it is written (a tool call's arguments stream too: `CallStream`). The grammar makes the answer valid JSON
    written as `json.dumps` writes it, so a direct answer starts with exactly `START`."""

    START = '{"response": "'
    ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "b": "\b", "f": "\f", "/": "/", "\\": "\\", '"': '"'}

    def __init__(self) -> None:
        self.raw = ""  # the answer's JSON text so far
        self.pos = 0  # characters of the string's JSON body decoded so far
        self.text = ""  # the response decoded so far
        self.ended = False  # the string's closing quote came

    @property
    def began(self) -> bool:
        return self.raw.startswith(self.START)

    def feed(self, piece: str) -> str:
        """Take the next piece of the answer's text; returns the response text it completes ("" for none)."""
        self.raw += piece
        if not self.began or self.ended:
            return ""
        body, i, out = self.raw[len(self.START):], self.pos, []
        while i < len(body):
            ch = body[i]
            if ch == '"':
                self.ended = True
                break
            if ch != "\\":
                out.append(ch)
                i += 1
                continue
            if i + 1 >= len(body):
                break  # an escape cut in two: wait for its rest
            if body[i + 1] != "u":
                out.append(self.ESCAPES.get(body[i + 1], body[i + 1]))
                i += 2
                continue
            if i + 6 > len(body):
                break
            code = int(body[i + 2 : i + 6], 16)
            if 0xD800 <= code < 0xDC00:  # a surrogate pair: \uD83D\uDE00
                if i + 12 > len(body):
                    break
                low = int(body[i + 8 : i + 12], 16) if body[i + 6 : i + 8] == "\\u" else -1
                if 0xDC00 <= low < 0xE000:
                    code = 0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)
                    i += 6
            out.append("\ufffd" if 0xD800 <= code < 0xE000 else chr(code))  # a lone surrogate: not text
            i += 6
        self.pos = i
        self.text += "".join(out)
        return "".join(out)


@dataclass
class CallPiece:
    """A piece of a streamed tool call: its start (`name`, with the `id` the call goes by) or more of its arguments'
    JSON text."""

    index: int  # the call's place in the answer
    arguments: str = ""
    name: str | None = None
    id: str | None = None

    def wire(self) -> dict[str, Any]:
        """OpenAI's `delta.tool_calls` entry."""
        if self.name is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


class CallStream:
    """The tool calls of an answer as it arrives (`{"tool_call": CALL}` or `{"tool_calls": [CALL, ...]}`, each CALL
    `{"name": ..., "arguments": VALUE}` as `json.dumps` writes it, which the grammar makes sure of): a call starts
    once its name is whole, then its arguments stream as the model writes their JSON text."""

    CALL = re.compile(r'\{"name": ("[^"\\]*"), "arguments": ')  # function names hold no quote or backslash

    def __init__(self) -> None:
        self.raw = ""
        self.pos = 0  # where the scan goes on in `raw`
        self.calls = 0  # calls started
        self.in_arguments = False
        self.depth = 0  # of the arguments' brackets
        self.in_string = self.escaped = False

    def feed(self, piece: str) -> list[CallPiece]:
        """Take the next piece of the answer's text; returns the call pieces it completes."""
        self.raw += piece
        out: list[CallPiece] = []
        while True:
            if not self.in_arguments:
                found = self.CALL.search(self.raw, self.pos)
                if found is None or not self.raw.startswith(('{"tool_call": ', '{"tool_calls": [')):
                    return out
                out.append(CallPiece(self.calls, name=json.loads(found.group(1)),
                                     id="call_" + uuid.uuid4().hex[:24]))
                self.pos, self.in_arguments, self.depth = found.end(), True, 0
            start, ended = self.pos, False
            while self.pos < len(self.raw) and not ended:
                ch = self.raw[self.pos]
                if self.in_string:
                    self.escaped, self.in_string = (not self.escaped and ch == "\\",
                                                    self.escaped or ch != '"')
                elif ch == '"':
                    self.in_string = True
                elif ch in "{[":
                    self.depth += 1
                elif ch in "}]" or (ch == "," and self.depth == 0):
                    if self.depth == 0:  # the call's own closing brace: a scalar value ended
                        ended = True
                        break
                    self.depth -= 1
                    ended = self.depth == 0
                self.pos += 1
            text = self.raw[start:self.pos]
            if text:
                if out and out[-1].index == self.calls:
                    out[-1].arguments += text
                else:
                    out.append(CallPiece(self.calls, arguments=text))
            if not ended:
                return out
            self.in_arguments = False
            self.calls += 1


def parse_tools(tools: Any, tool_choice: Any, parallel: Any = None) -> Tools | None:
    """A request's `tools`, `tool_choice` and `parallel_tool_calls` (OpenAI's forms; one call per answer unless
    `parallel` is true, as llama.cpp's server answers); None when no tool may be called. A UserError names what is
    wrong."""
    if parallel is not None and not isinstance(parallel, bool):
        raise UserError(f"parallel_tool_calls must be true or false (got {parallel!r})")
    if tools is None or tools == []:
        if tool_choice not in (None, "none", "auto"):
            raise UserError("tool_choice asks for a tool call but the request has no 'tools'")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise UserError(f"tools must be a list of up to {MAX_TOOLS} {{\"type\": \"function\", \"function\": {{...}}}} "
                        "objects")
    functions = []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"] \
                or not set(f["name"]) <= NAME_CHARS or len(f["name"]) > 64:
            raise UserError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": a name of "
                            "letters, digits, _ and - (up to 64), \"description\": ..., \"parameters\": "
                            "{a JSON schema}}}")
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise UserError(f"tools[{i}].function.parameters must be a JSON schema object")
        description = f.get("description", "")
        if not isinstance(description, str):
            raise UserError(f"tools[{i}].function.description must be a string")
        functions.append({"name": f["name"], "description": description, "parameters": params})
    names = [f["name"] for f in functions]
    if len(set(names)) < len(names):
        raise UserError("tools: two functions have the same name")
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, dict):
        name = choice.get("function", {}).get("name") if isinstance(choice.get("function"), dict) else None
        if choice.get("type") != "function" or name not in names:
            raise UserError("tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                            f"\"function\": {{\"name\": one of {', '.join(names)}}}}}")
        choice = name
    elif choice not in ("none", "auto", "required"):
        raise UserError("tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                        "\"function\": {\"name\": ...}}")
    return None if choice == "none" else Tools(functions, choice, bool(parallel))


def template_messages(messages: list[dict[str, Any]], tools: Tools | None) -> list[dict[str, str]]:
    """Checked chat messages (tool calls and results included) as the {role, content} messages a chat template
    renders, with the tools described in the system message."""
    out = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": json.dumps(
                {"tool_response": {"name": m.get("name", ""), "content": m["content"]}}, ensure_ascii=False)})
        elif m.get("tool_calls"):
            calls = [{"name": c["name"], "arguments": c["arguments"]} for c in m["tool_calls"]]
            text = json.dumps({"tool_calls": calls}, ensure_ascii=False) if tools is not None and tools.parallel \
                else "\n".join(json.dumps({"tool_call": c}, ensure_ascii=False) for c in calls)
            out.append({"role": "assistant", "content": text})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if tools is not None:
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + tools.system_text()}
        else:
            out.insert(0, {"role": "system", "content": tools.system_text()})
    return out
