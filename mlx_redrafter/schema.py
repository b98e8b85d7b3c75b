"""Typed config fields with ranges: each config file kind is a table of `Field`s, checked by one function.

A value of the wrong JSON type (a string where an integer belongs, 1e8 where an integer belongs, a NaN), out of
range (zero heads, a billion layers) or missing (when required) is a one-line `UserError` naming the file, the
key, the value and what is expected. The upper bounds are far above any real model: they exist so a typo cannot
make us build a billion modules or allocate terabytes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mlx_redrafter.errors import UserError
from mlx_redrafter.files import json_type

# Sanity bounds shared by the target and drafter schemas.
MAX_VOCAB = 1 << 22  # 4M tokens (the largest real vocabularies are ~256k)
MAX_WIDTH = 1 << 17  # hidden / exit / intermediate sizes up to 131072
MAX_FFN = 1 << 20
MAX_LAYERS = 1024
MAX_HEADS = 1024
MAX_DRAFT_LAYERS = 64  # ResBlocks of a draft head
MAX_CONTEXT = 1 << 24


@dataclass(frozen=True)
class Field:
    """One config key: its JSON type (int, float, bool or str), inclusive range or choices, and whether it must be
    there (an absent key or JSON null means "not set")."""

    key: str
    kind: type
    lo: float | None = None
    hi: float | None = None
    required: bool = False
    choices: tuple[Any, ...] = ()
    positive: bool = False  # float: strictly above zero

    def expected(self) -> str:
        """What a valid value looks like, for messages."""
        if self.choices:
            return "one of " + ", ".join(map(repr, self.choices))
        if self.kind is int:
            return f"an integer from {self.lo:,} to {self.hi:,}" if self.hi is not None else \
                f"an integer >= {self.lo:,}"
        if self.kind is float:
            low = "> 0" if self.positive else f">= {self.lo:g}" if self.lo is not None else ""
            high = f"<= {self.hi:g}" if self.hi is not None else ""
            return "a finite number" + (f" {low}" if low else "") + (f" and {high}" if high else "")
        return {bool: "true or false", str: "a string"}.get(self.kind, self.kind.__name__)

    def valid(self, v: Any) -> bool:
        """Whether `v` (a set value) has the right type and lies in range."""
        if self.kind is int:
            ok = type(v) is int
        elif self.kind is float:
            ok = type(v) in (int, float) and math.isfinite(v) and (not self.positive or v > 0)
        else:
            ok = type(v) is self.kind
        if ok and self.choices:
            return v in self.choices
        if ok and self.kind in (int, float):
            return (self.lo is None or v >= self.lo) and (self.hi is None or v <= self.hi)
        return ok

    def check(self, cfg: Mapping[str, Any], where: str) -> None:
        """One-line UserError unless cfg[key] is valid (or absent and not required)."""
        v = cfg.get(self.key)
        if v is None:
            if self.required:
                raise UserError(f"{where} lacks {self.key} ({self.expected()})")
            return
        if not self.valid(v):
            raise UserError(f"{where}: {self.key} = {shown(v)} is not {self.expected()}")


def check_option(option: str, value: Any, field: Field) -> Any:
    """`value`, or a one-line UserError `OPTION must be EXPECTED (got VALUE)` unless it is None (not given) or valid
    for `field` (its key is ignored): one range check for a command-line option, before any work."""
    if value is not None and not field.valid(value):
        raise UserError(f"{option} must be {field.expected()} (got {shown(value)})")
    return value


def check_http_url(url: str, option: str, example: str = "http://127.0.0.1:8080/v1") -> str:
    """`url` without a trailing slash, or a one-line UserError unless it is an http(s) URL with a host and, if
    it names one, a port from 1 to 65535."""
    from urllib.parse import urlsplit

    base = url.strip().rstrip("/")
    try:
        parts = urlsplit(base)
        port = parts.port
    except ValueError:
        parts, port = None, None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or port == 0:
        raise UserError(f"{option} must be an http(s) URL with a host and a port from 1 to 65535, such as "
                        f"{example} (got {shown(url)})")
    return base


def shown(v: Any, limit: int = 60) -> str:
    """repr of a value, cut to `limit` characters (a config value can be a megabyte of text)."""
    r = repr(v)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def check_object(cfg: Any, where: str) -> Mapping[str, Any]:
    """`cfg` itself, or a one-line UserError unless it is a JSON object (a dict)."""
    if not isinstance(cfg, Mapping):
        raise UserError(f"{where} is a JSON {json_type(cfg)}, expected an object ({{\"key\": value, ...}})")
    return cfg


def check_fields(cfg: Any, fields: Sequence[Field], where: str) -> Mapping[str, Any]:
    """Check every field of a config object; returns it. One-line UserError for the first bad one."""
    check_object(cfg, where)
    for f in fields:
        f.check(cfg, where)
    return cfg
