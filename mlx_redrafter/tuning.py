"""Tuned decoding settings per machine + model + drafter: where they live and how the CLI resolves them.

`redrafter-mlx tune` measures a small W x L (x dtype) grid against AR and stores the winner here; when no cell
beats AR it stores that too, and decoding then runs plain AR. Resolution order for generate/chat:
explicit flags > tuned entry > built-in default (DEFAULT_BEAM_WIDTH x DEFAULT_BEAM_LENGTH when a drafter is present).
File: $REDRAFTER_TUNED_FILE, else $XDG_CACHE_HOME/redrafter-mlx/tuned.json (~/.cache/... by default).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from .errors import UserError

# Built-in default without a tuned entry: the best cell of bench/results/cpu (shipped drafter, fp32, MKL).
DEFAULT_BEAM_WIDTH = 1
DEFAULT_BEAM_LENGTH = 2
FORMAT_VERSION = 1


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
    from .loader import DEFAULT_MODEL, resolve_model

    name, path = resolve_model(model)
    return name if name == DEFAULT_MODEL else str(Path(path).resolve())


def drafter_key(drafter: str | None, model: str | None) -> str | None:
    """Stable name of a drafter spec ('default' resolves to the shipped one); None when there is no drafter."""
    from .api import shipped_drafter_path
    from .loader import resolve_model

    if drafter in (None, "", "none"):
        return None
    if drafter.startswith("random"):
        return drafter
    if drafter == "default":
        path = shipped_drafter_path(resolve_model(model)[0])
        if path is None:
            return None
        return f"shipped:{path.name}@{_signature(path)}"
    p = Path(drafter).expanduser()
    if not p.exists():
        return drafter  # load_drafter reports the missing path
    return f"{p.resolve()}@{_signature(p)}"


def entry_key(machine: str, model: str, drafter: str) -> str:
    return f"{machine}|{model}|{drafter}"


def read_all(path: Path | None = None) -> dict[str, Any]:
    """All stored entries ({} when the file is missing); a corrupt file is a one-line UserError."""
    path = path or tuned_file()
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"tuned settings file {path} is unreadable ({type(e).__name__}): delete it or re-run "
                        f"`redrafter-mlx tune`") from None
    if not isinstance(data, dict) or not isinstance(data.get("entries", {}), dict):
        raise UserError(f"tuned settings file {path} has an unexpected layout: delete it or re-run tune")
    return data.get("entries", {})


def lookup(model: str | None, drafter: str | None) -> dict[str, Any] | None:
    """The tuned entry for this machine + model + drafter spec, or None."""
    from .machine import fingerprint

    dkey = drafter_key(drafter, model)
    if dkey is None:
        return None
    return read_all().get(entry_key(fingerprint(), model_key(model), dkey))


def store(model: str | None, drafter: str, entry: dict[str, Any]) -> Path:
    """Write (atomically) the entry for this machine + model + drafter spec; returns the file path."""
    from .machine import fingerprint, machine_info

    dkey = drafter_key(drafter, model)
    if dkey is None:
        raise UserError("there is no drafter to store tuned settings for")
    path = tuned_file()
    entries = read_all(path)
    entries[entry_key(fingerprint(), model_key(model), dkey)] = {
        **entry, "model": model_key(model), "drafter": dkey, "machine": machine_info()["cpu"],
        "backend": machine_info()["backend"], "mlx": machine_info()["mlx"],
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    write_json_atomic(path, {"version": FORMAT_VERSION, "entries": entries})
    return path


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write JSON via a temp file in the same directory and rename (never a half-written file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=True)
            f.write("\n")
        os.chmod(tmp, 0o644)  # mkstemp creates 0600
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@dataclass
class Decoding:
    """Resolved decoding settings and where they came from ('flags', 'tuned' or 'default')."""

    beam_width: int
    beam_length: int
    dtype: str
    no_draft: bool
    source: str


def resolve(model: str | None, drafter: str | None, beam_width: int | None, beam_length: int | None,
            dtype: str, no_draft: bool) -> Decoding:
    """Explicit flags > tuned entry for this machine/model/drafter > built-in default."""
    if no_draft:
        return Decoding(0, 0, dtype, True, "flags")
    if beam_width is not None or beam_length is not None:
        return Decoding(beam_width if beam_width is not None else DEFAULT_BEAM_WIDTH,
                        beam_length if beam_length is not None else DEFAULT_BEAM_LENGTH, dtype, False, "flags")
    entry = lookup(model, drafter)
    if entry is not None:
        tuned_dtype = entry.get("dtype") or dtype
        use_dtype = tuned_dtype if dtype == "auto" else dtype
        if entry.get("decision") == "ar":
            return Decoding(0, 0, use_dtype, True, "tuned")
        return Decoding(int(entry["beam_width"]), int(entry["beam_length"]), use_dtype, False, "tuned")
    return Decoding(DEFAULT_BEAM_WIDTH, DEFAULT_BEAM_LENGTH, dtype, False, "default")
