"""Function calling for any model: OpenAI's `tools` and `tool_choice`, answered in one JSON format the grammar
enforces (llama.cpp's generic tool format).

The tools are described to the model in the system message, and the answer is constrained (constraint.py) to
`{"tool_call": {"name": ..., "arguments": {...}}}` (the arguments follow that function's `parameters` schema) or,
with `tool_choice` "auto", `{"response": "text"}`. The server turns a tool call into the assistant message's
`tool_calls` (finish_reason "tool_calls") and a response into its `content`. Earlier turns go back to the template
in the same format: an assistant message's `tool_calls` as the JSON the model wrote, a `tool` message (a result)
as a user message holding `{"tool_response": {"name": ..., "content": ...}}`.
"""

from __future__ import annotations

import json
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

    def schema(self) -> dict[str, Any]:
        """The JSON schema the answer follows."""
        def call(f: dict[str, Any]) -> dict[str, Any]:
            return {"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
                    "required": ["name", "arguments"], "additionalProperties": False}

        offered = [f for f in self.functions if self.choice in ("auto", "required", f["name"])]
        calls = {"type": "object", "properties": {"tool_call": {"anyOf": [call(f) for f in offered]}},
                 "required": ["tool_call"], "additionalProperties": False}
        if self.choice != "auto":
            return calls
        text = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
                "additionalProperties": False}
        return {"anyOf": [calls, text]}

    def system_text(self) -> str:
        """What the system message tells the model about the tools and the answer's format."""
        listed = json.dumps([{"name": f["name"], "description": f["description"], "parameters": f["parameters"]}
                             for f in self.functions], ensure_ascii=False)
        how = {"auto": 'To call a tool, answer {"tool_call": {"name": "<tool name>", "arguments": {...}}}; to answer '
                       'directly, answer {"response": "<your answer>"}.',
               "required": 'Call a tool: answer {"tool_call": {"name": "<tool name>", "arguments": {...}}}.'}
        return (f"You can use these tools: {listed}\n"
                + how.get(self.choice, f'Call the tool {self.choice}: answer {{"tool_call": {{"name": '
                                       f'"{self.choice}", "arguments": {{...}}}}}}.'))

    def message(self, text: str) -> tuple[dict[str, Any], str | None]:
        """The assistant message of an answer's text, and the finish reason it implies (None: the caller's)."""
        try:
            value = json.loads(text)
        except ValueError:  # cut before the JSON ended (max_tokens)
            return {"role": "assistant", "content": text}, None
        if isinstance(value, dict) and isinstance(value.get("tool_call"), dict):
            call = value["tool_call"]
            return {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                "function": {"name": call.get("name"), "arguments": json.dumps(call.get("arguments"),
                                                                              ensure_ascii=False)}}]}, "tool_calls"
        if isinstance(value, dict) and isinstance(value.get("response"), str):
            return {"role": "assistant", "content": value["response"]}, None
        return {"role": "assistant", "content": text}, None


def parse_tools(tools: Any, tool_choice: Any) -> Tools | None:
    """A request's `tools` and `tool_choice` (OpenAI's forms); None when no tool may be called. A UserError names
    what is wrong."""
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
    return None if choice == "none" else Tools(functions, choice)


def template_messages(messages: list[dict[str, Any]], tools: Tools | None) -> list[dict[str, str]]:
    """Checked chat messages (tool calls and results included) as the {role, content} messages a chat template
    renders, with the tools described in the system message."""
    out = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": json.dumps(
                {"tool_response": {"name": m.get("name", ""), "content": m["content"]}}, ensure_ascii=False)})
        elif m.get("tool_calls"):
            calls = [{"tool_call": {"name": c["name"], "arguments": c["arguments"]}} for c in m["tool_calls"]]
            text = "\n".join(json.dumps(c, ensure_ascii=False) for c in calls)
            out.append({"role": "assistant", "content": text})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if tools is not None:
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + tools.system_text()}
        else:
            out.insert(0, {"role": "system", "content": tools.system_text()})
    return out
