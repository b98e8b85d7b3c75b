"""Chat templates: render a model's own Jinja template (as transformers does) or a built-in one.

Built-ins cover models that ship without a template: Vicuna v1.1 (also v1.3 / v1.5, FastChat's
`vicuna_v1.1` conversation) and ChatML. `pick_template` decides which one a loaded model uses.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox

from mlx_redrafter.errors import UserError

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
TEMPLATE_CHOICES = ("own", *BUILTIN, "FILE.jinja")


def builtin_name(template: str | None) -> str | None:
    """The built-in name of a template text, if it is one."""
    return next((k for k, v in BUILTIN.items() if v == template), None)


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
    """A --template value: a built-in name or a .jinja file -> template text ('own' is handled by callers)."""
    if value in BUILTIN:
        return BUILTIN[value]
    p = Path(value).expanduser()
    if p.suffix == ".jinja" and p.is_file():
        return p.read_text()
    raise UserError(f"--template must be 'own', one of {', '.join(BUILTIN)} or an existing .jinja file "
                    f"(got {value!r})")


def _raise(msg: str) -> None:
    raise UserError(f"chat template: {msg}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateError as e:
        raise UserError(f"chat template does not parse: {e}") from None


def render(template: str, messages: list[dict[str, str]], *, bos_token: str = "", eos_token: str = "",
           add_generation_prompt: bool = True) -> str:
    """Render `messages` with a Jinja chat template (the variables transformers' templates expect)."""
    try:
        return _compile(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=bos_token, eos_token=eos_token, default_system=VICUNA_SYSTEM)
    except jinja2.TemplateError as e:
        raise UserError(f"chat template failed: {e}") from None
