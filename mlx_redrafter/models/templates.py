"""Chat templates: render a model's own Jinja template (as transformers does) or a built-in one.

Built-ins cover models that ship without a template: Vicuna v1.1 (also v1.3 / v1.5, FastChat's
`vicuna_v1.1` conversation) and ChatML. `pick_template` decides which one a loaded model uses.
"""

from __future__ import annotations

import functools
import json
import math
import re
import sys
import time
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.filters
import jinja2.sandbox

from mlx_redrafter.errors import UserError
from mlx_redrafter.files import read_text

try:
    import resource
except ImportError:  # Windows
    resource = None  # type: ignore[assignment]

VICUNA_SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. The assistant gives "
                 "helpful, detailed, and polite answers to the user's questions.")

# FastChat vicuna_v1.1: "<s>{system} USER: {q} ASSISTANT: {a}</s>USER: {q2} ASSISTANT:"
VICUNA = (
    "{% if messages and messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
    "{% set turns = messages[1:] %}{% else %}{% set system = default_system %}{% set turns = messages %}{% endif %}"
    "{{ bos_token }}{{ system }} "
    "{% for m in turns %}{% if m['role'] == 'user' %}USER: {{ m['content'] }} "
    "{% elif m['role'] == 'assistant' %}ASSISTANT: {{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

BUILTIN = {"vicuna": VICUNA, "chatml": CHATML}


def pick_template(own: str | None, kind: str | None = None, name_hint: str = "") -> tuple[str | None, str]:
    """(template text, description) for a model.

    `kind` comes from the model registry ('own', 'vicuna', ...); without one, a model's own template wins, and
    a model without one whose name says Vicuna gets the Vicuna template."""
    if kind in BUILTIN and not own:
        return BUILTIN[kind], f"built-in {kind}"
    if kind and kind not in ("own", *BUILTIN):
        raise UserError(f"unknown chat template kind {kind!r}")
    if own:
        return own, "the model's own"
    if "vicuna" in name_hint.lower():
        return VICUNA, "built-in vicuna"
    return None, "none"


def load_template_option(value: str) -> str:
    """A --template value: a built-in name or a .jinja file -> template text ('own' is handled by callers). A file
    must render the sample conversations (`check_template`), so a broken one fails before a chat starts."""
    if value in BUILTIN:
        return BUILTIN[value]
    p = Path(value).expanduser()
    if p.suffix == ".jinja" and p.is_file():
        text = read_text(p, "chat template")
        check_template(text, f"the chat template (--template {p})")
        return text
    raise UserError(f"--template must be 'own', one of {', '.join(BUILTIN)} or an existing .jinja file "
                    f"(got {value!r})")


# Rendering budget: a template is code from a model file, so it runs sandboxed (no attribute writes, no unsafe
# calls) and within these limits. Real chat templates take about a millisecond and a few kilobytes.
RENDER_SECONDS = 2.0  # CPU time of one compile or render (not wall time: a busy or low-priority process waits)
MAX_CHARS = 16_000_000  # output, and any string or list one operation builds
MAX_ARG = 1_000_000  # an integer passed to a filter or method (widths, counts: center, indent, slice, batch, ...)
MAX_MEMORY = 512 << 20  # bytes the process may grow by while a template runs
_BIG_NUMBER = re.compile(r"\d{7,}")  # a width of a million characters or more in a format string


class _OverBudget(BaseException):
    """A template ran past its budget. A BaseException, so no `except Exception` inside Jinja swallows it."""


class _Budget:
    """Time and memory limits for one compile or render, checked on every line the template's code runs
    (sys.settrace), plus the checks of single operations that could build something huge at once."""

    def __init__(self) -> None:
        self.deadline = time.thread_time() + RENDER_SECONDS
        self.rss0 = _max_rss()
        self.events = 0

    def trace(self, frame: Any, event: str, arg: Any) -> Any:
        self.events += 1
        if time.thread_time() > self.deadline:
            raise _OverBudget(f"it ran longer than {RENDER_SECONDS:g} s of CPU time (an endless or huge loop?)")
        if self.events % 8 == 0 and _max_rss() - self.rss0 > MAX_MEMORY:
            raise _OverBudget(f"it used more than {MAX_MEMORY >> 20} MB of memory")
        return self.trace

    def run(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """fn(*args, **kwargs) under this budget (the previous trace function, if any, is restored)."""
        previous = sys.gettrace()
        sys.settrace(self.trace)
        try:
            return fn(*args, **kwargs)
        finally:
            sys.settrace(previous)


def _max_rss() -> int:
    """Peak resident memory of this process in bytes (0 where the platform does not say)."""
    if resource is None:
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _check_args(args: tuple, kwargs: dict) -> None:
    for a in (*args, *kwargs.values()):
        if type(a) is int and abs(a) > MAX_ARG:
            raise _OverBudget(f"it passes {a} to a filter or method (at most {MAX_ARG:,})")


def _check_format(fmt: Any) -> None:
    if isinstance(fmt, str) and _BIG_NUMBER.search(fmt):
        raise _OverBudget(f"its format string {fmt[:40]!r} asks for a width of a million characters or more")


def _guarded(f: Any) -> Any:
    """A filter with its integer arguments bounded (keeps Jinja's pass_context / pass_environment marks)."""

    @functools.wraps(f)
    def filter_(*args: Any, **kwargs: Any) -> Any:
        _check_args(args, kwargs)
        if f is jinja2.filters.do_format and args:
            _check_format(args[0])
        return f(*args, **kwargs)

    return filter_


class _Sandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, with the operations that can build something huge in one step bounded."""

    intercepted_binops = frozenset({"*", "**", "%"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            seq, n = (left, right) if isinstance(left, (str, list, tuple)) else (right, left)
            if isinstance(seq, (str, list, tuple)) and type(n) is int and len(seq) * n > MAX_CHARS:
                raise _OverBudget(f"it repeats a sequence of {len(seq):,} items {n:,} times")
        elif operator == "**" and type(left) is int and type(right) is int and abs(left) > 1 and \
                right * math.log2(abs(left)) > 1e5:
            raise _OverBudget(f"it computes {left} ** {right}")
        elif operator == "%":
            _check_format(left)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (Jinja's API)
        _check_args(args, kwargs)
        if getattr(__obj, "__name__", "") in ("format", "format_map"):  # str.format, as the sandbox wraps it
            _check_format(getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None))
        return super().call(__context, __obj, *args, **kwargs)


class TemplateRaised(Exception):
    """What a template's raise_exception(message) raises (transformers' name for the function)."""


def _raise(msg: str) -> None:
    raise TemplateRaised(msg)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters = {name: _guarded(f) for name, f in {**env.filters, "tojson": _tojson}.items()}
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)  # compiled under the caller's budget (Jinja folds constants here)


def render(template: str, messages: list[dict[str, str]], *, bos_token: str = "", eos_token: str = "",
           add_generation_prompt: bool = True, name: str = "chat template") -> str:
    """Render `messages` with a Jinja chat template (the variables transformers' templates expect), sandboxed
    and within a time, memory and output budget. Anything that goes wrong (a syntax error, an exception the
    template raises, a division by zero, a type error, a loop that never ends) is one UserError line naming the
    template (`name`)."""
    def run() -> str:
        out: list[str] = []
        size = 0
        for piece in _compile(template).generate(
                messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos_token,
                eos_token=eos_token, default_system=VICUNA_SYSTEM):
            size += len(piece)
            if size > MAX_CHARS:
                raise _OverBudget(f"its output passed {MAX_CHARS:,} characters")
            out.append(piece)
        return "".join(out)

    try:
        return _Budget().run(run)
    except TemplateRaised as e:
        raise UserError(f"{name} refused the messages: {first_line(e)}") from None
    except _OverBudget as e:
        raise UserError(f"{name} was stopped: {e}; fix or replace the template (--template)") from None
    except jinja2.TemplateSyntaxError as e:
        raise UserError(f"{name} does not parse: {first_line(e)} (line {e.lineno})") from None
    except (Exception, RecursionError) as e:  # the template's own errors: ZeroDivisionError, TypeError, ...
        raise UserError(f"{name} failed: {type(e).__name__}: {first_line(e)}") from None


# Conversations every chat template must render: a first message, and a second turn after an answer.
SAMPLE_CONVERSATIONS = (
    [{"role": "user", "content": "Hello!"}],
    [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi. How can I help?"},
     {"role": "user", "content": "Name a colour."}],
)


def check_template(template: str, name: str) -> None:
    """One-line UserError (naming the template as `name`) unless `template` renders `SAMPLE_CONVERSATIONS` to text
    within the rendering budget: a template that fails on any conversation fails here, once, up front."""
    for messages in SAMPLE_CONVERSATIONS:
        out = render(template, messages, bos_token="<s>", eos_token="</s>", name=name)
        if not isinstance(out, str):
            raise UserError(f"{name} rendered no text")


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (at most 200 characters), or its type's name when it has none:
    for one-line errors about a file's content."""
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__
