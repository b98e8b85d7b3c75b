"""Tuned decoding settings per machine + model + drafter: where they live and how generate/chat resolve them.

`redrafter-mlx tune` measures a small grid against AR and stores the winner here; when nothing beats AR it
stores that too, and decoding then runs plain AR. Resolution, field by field: an explicit flag > the tuned
entry's value > the built-in default (defaults.py); a drafting flag given where the tuned entry says plain AR
drafts anyway (`auto`). File: $REDRAFTER_TUNED_FILE, else $XDG_CACHE_HOME/redrafter-mlx/tuned.json.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from mlx_redrafter.draft import modes
from mlx_redrafter.draft.modes import CHOICES
from mlx_redrafter.drafter_spec import parse_drafter_spec
from mlx_redrafter.errors import UserError
from mlx_redrafter.files import read_json, write_atomic
from mlx_redrafter.models.loader import DTYPE_CHOICES
from mlx_redrafter.options import DecodeOptions
from mlx_redrafter.schema import Field, check_fields
from mlx_redrafter.shipped import shipped_drafter_path

FORMAT_VERSION = 2
# The entry keys decoding reads, with their types (ranges are checked with the options: DecodeOptions.check).
ENTRY_FIELDS = (
    Field("draft", str, choices=CHOICES),
    Field("beam_width", int, 1, 1 << 16),
    Field("beam_length", int, 1, 1 << 16),
    Field("lookup_width", int, 1, 1 << 16),
    Field("dtype", str, choices=DTYPE_CHOICES),
)


def tuned_file() -> Path:
    """Path of the tuned-settings JSON (env REDRAFTER_TUNED_FILE overrides)."""
    env = os.environ.get("REDRAFTER_TUNED_FILE")
    if env:
        return Path(env).expanduser()
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "redrafter-mlx" / "tuned.json"


@lru_cache(maxsize=32)
def _content_hash(path: str, size: int, mtime: float) -> str:
    h = hashlib.sha256()
    p = Path(path)
    files = sorted(f for f in p.iterdir() if f.is_file()) if p.is_dir() else [p]
    for f in files:
        if f.suffix in (".json", ".safetensors") or f == p:
            h.update(f.name.encode())
            with f.open("rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 22), b""):
                    h.update(chunk)
    return h.hexdigest()[:12]


def _signature(path: Path) -> str:
    """Content hash of a drafter file/directory (cached per size and mtime)."""
    st = path.stat()
    newest = max([st.st_mtime] + ([f.stat().st_mtime for f in path.iterdir()] if path.is_dir() else []))
    return _content_hash(str(path.resolve()), st.st_size, newest)


def model_key(model: str | None) -> str:
    """Stable name of a target model spec: the default's name, or the resolved local path."""
    from mlx_redrafter.models.loader import DEFAULT_MODEL, resolve_model

    name, path = resolve_model(model)
    return name if name == DEFAULT_MODEL else str(Path(path).resolve())


def drafter_key(drafter: str | None, model: str | None) -> str:
    """Stable name of a drafter spec ('default' resolves to the shipped one, with a content hash)."""
    from mlx_redrafter.models.loader import resolve_model

    d = parse_drafter_spec(drafter)
    if d.kind == "default":
        path = shipped_drafter_path(resolve_model(model)[0])
        return "none" if path is None else f"shipped:{path.name}@{_signature(path)}"
    if d.kind == "path":
        p = Path(d.path).expanduser()
        return f"{p.resolve()}@{_signature(p)}" if p.exists() else d.path  # loading reports a missing path
    return drafter or "none"


def entry_key(machine: str, model: str, drafter: str) -> str:
    return f"{machine}|{model}|{drafter}"


def read_all(path: Path | None = None) -> dict[str, Any]:
    """All stored entries ({} when the file is missing), each checked against `ENTRY_FIELDS`; a file that is not
    UTF-8 JSON of the expected layout, or an entry of the wrong types, is a one-line UserError."""
    path = path or tuned_file()
    if not path.exists():
        return {}
    fix = "delete it or re-run `redrafter-mlx tune`"
    try:
        data = read_json(path, "tuned settings file")
    except UserError as e:
        raise UserError(f"{e}: {fix}") from None
    entries = data.get("entries", {})
    if not isinstance(entries, dict):
        raise UserError(f"tuned settings file {path} has an unexpected layout: {fix}")
    if data.get("version") != FORMAT_VERSION:
        return {}  # written by an older version: ignored (re-run tune)
    for key, entry in entries.items():
        where = f"tuned settings file {path}, entry {key!r}"
        try:
            check_fields(entry, ENTRY_FIELDS, where)
            check_tuned_values({k: entry[k] for k in TUNED_FIELDS if k in entry}, where)
        except UserError as e:
            raise UserError(f"{e}: {fix}") from None
    return entries


def check_tuned_values(values: dict[str, Any], where: str) -> None:
    """One-line UserError unless tuned `values` pass the options' own check (`DecodeOptions.check`: the same
    ranges as the flags), saying that the bad value came from `where`, not from a flag."""
    try:
        DecodeOptions().updated(**values).check()
    except UserError as e:
        raise UserError(f"{where} holds a value out of range, not a flag you gave ({e})") from None


def lookup(model: str | None, drafter: str | None) -> dict[str, Any] | None:
    """The tuned entry for this machine + model + drafter spec, or None."""
    from mlx_redrafter.system.machine import fingerprint

    return read_all().get(entry_key(fingerprint(), model_key(model), drafter_key(drafter, model)))


def store(model: str | None, drafter: str | None, entry: dict[str, Any]) -> Path:
    """Write (atomically) the entry for this machine + model + drafter spec; returns the file path."""
    from mlx_redrafter.system.machine import fingerprint, machine_info

    dkey = drafter_key(drafter, model)
    path = tuned_file()
    entries = read_all(path)
    info = machine_info()
    entries[entry_key(fingerprint(), model_key(model), dkey)] = {
        **entry, "model": model_key(model), "drafter": dkey, "machine": info["cpu"], "backend": info["backend"],
        "mlx": info["mlx"], "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    write_atomic(path, json.dumps({"version": FORMAT_VERSION, "entries": entries}, indent=2, sort_keys=True) + "\n")
    return path


@dataclass
class Resolved:
    """Decoding options and dtype, where each given or tuned option came from ('flag' or 'tuned'; the rest are
    defaults), and notes worth a line to the user."""

    options: DecodeOptions
    dtype: str
    origin: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def source(self) -> str:
        """'tuned' when a tuned value is in use, else 'flags' when any option was given, else 'default'."""
        values = set(self.origin.values())
        return "tuned" if "tuned" in values else "flags" if values else "default"


TUNED_FIELDS = ("draft", "beam_width", "beam_length", "lookup_width")
DRAFTING_FLAGS = ("beam_width", "beam_length", "lookup_width", "medusa_tree", "drafter_vocab", "draft_confidence")


def resolve(model: str | None, drafter: str | None, flags: dict[str, Any], dtype: str) -> Resolved:
    """Options from flags (by flat name; None = not given) over the tuned entry for this machine, model and
    drafter, over the defaults, field by field; checked."""
    given = {k: v for k, v in flags.items() if v is not None}
    entry = lookup(model, drafter) or {}
    tuned = {k: entry[k] for k in TUNED_FIELDS if k in entry and k not in given}
    if "draft" in tuned and modes.get(tuned["draft"]).drafter and parse_drafter_spec(drafter).kind == "none":
        raise UserError(f"the tuned settings file {tuned_file()} says --draft {tuned['draft']} for this machine and "
                        f"model, but no drafter is loaded (--drafter none): give --draft, or delete that entry or "
                        f"re-run `redrafter-mlx tune`")
    notes = []
    if "draft" in tuned and not modes.get(tuned["draft"]).drafts and any(k in given for k in DRAFTING_FLAGS):
        del tuned["draft"]
        notes.append("the tuned settings say plain decoding is fastest here, but a drafting option was given: "
                     "drafting with --draft auto")
    options = DecodeOptions().updated(**tuned, **given)
    options.check()
    use_dtype = entry.get("dtype") or dtype if dtype == "auto" else dtype
    origin = {**{k: "tuned" for k in tuned}, **{k: "flag" for k in given}}
    return Resolved(options, use_dtype, origin, notes)
