"""Reading and writing the files users hand us: never a half-written file, never a traceback on a bad one.

`write_atomic` writes a temp file in the same folder, flushes it to disk, renames it over the target and
flushes the folder, so after a crash the path holds the old contents or the new, never a mix or nothing.
`read_text` / `read_json` turn every way a text file can be unreadable (missing, a directory, no permission,
not UTF-8, not JSON, not the expected JSON type) into one `UserError` line naming the file and the fix.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from mlx_redrafter.errors import UserError


def fsync_dir(path: str | Path) -> None:
    """Flush a directory's entries (a rename or a new file in it) to disk; a no-op where directories cannot be
    opened (Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories: the rename itself is still atomic
    finally:
        os.close(fd)


def _nearest_existing(path: Path) -> Path:
    """`path` itself if it exists, else its nearest existing ancestor."""
    path = path.absolute()
    for p in (path, *path.parents):
        if p.exists():
            return p
    return Path(path.anchor)


def _check_location(path: Path, folder: Path, what: str, probe: bool = True) -> None:
    """A UserError (naming `path` as `what`) unless `folder` exists or can be made, and (with `probe`) a file can
    be created in it (checked by creating and removing an empty one: permission bits, read-only mounts and /proc
    alike)."""
    base = _nearest_existing(folder)
    if not base.is_dir():
        raise UserError(f"{what} {path} cannot be created: {base} is a file, not a directory: choose another path")
    if not probe:
        return
    try:
        fd, scratch = tempfile.mkstemp(prefix=".write-check.", dir=base)
        os.close(fd)
        os.unlink(scratch)
    except OSError as e:
        raise UserError(f"{what} {path} cannot be written: {base}: {e.strerror or type(e).__name__}; "
                        "choose a writable location") from None


def _check_named(path: str | Path, what: str) -> Path:
    if not str(path).strip():
        raise UserError(f"{what} is empty: give a path")
    return Path(path)


def check_writable_file(path: str | Path, what: str, probe: bool = True) -> Path:
    """`path` as a Path, or a one-line UserError (naming it as `what`) unless a file can be written there: a
    non-empty path, not a directory or a device, pipe or socket, in a folder that exists or can be made and (with
    `probe`) that takes new files. For the start of a command, before any work."""
    path = _check_named(path, what)
    if path.is_dir():
        raise UserError(f"{what} {path} is a directory: give a file path")
    if path.exists() and not path.is_file():
        raise UserError(f"{what} {path} is not a regular file (a device, pipe or socket): give a file path")
    _check_location(path, path.parent, what, probe)
    return path


def check_writable_dir(path: str | Path, what: str) -> Path:
    """`path` as a Path, or a one-line UserError (naming it as `what`) unless it is or can become a directory
    that takes new files: a non-empty path, not a file. For the start of a command."""
    path = _check_named(path, what)
    if path.exists() and not path.is_dir():
        raise UserError(f"{what} {path} is a file: give a directory")
    _check_location(path, path, what)
    return path


def write_atomic(path: str | Path, data: str | bytes, mode: int = 0o644) -> Path:
    """Write `data` to `path` via a temp file in the same directory, fsync, atomic rename and a directory fsync;
    returns the path. A path that cannot be written (a directory, under a file, no permission, a full disk) is a
    one-line UserError, and the temp file is removed."""
    path = check_writable_file(path, "output file", probe=False)  # the write itself says why it cannot be made
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)  # mkstemp creates 0600
        os.replace(tmp, path)
    except OSError as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise UserError(f"cannot write {path}: {e.strerror or type(e).__name__}") from None
    except BaseException:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def fsync_tree(folder: str | Path, files: bool = True) -> None:
    """Flush a directory's files (with `files`) and the directory itself to disk."""
    folder = Path(folder)
    if files:
        for f in folder.iterdir():
            if f.is_file() and not f.is_symlink():
                with f.open("rb") as fh:
                    os.fsync(fh.fileno())
    fsync_dir(folder)


def read_bytes(path: str | Path, what: str) -> bytes:
    """The bytes of a file; a one-line UserError (naming it as `what`) if it is missing, a directory or
    unreadable."""
    p = Path(path)
    try:
        return p.read_bytes()
    except FileNotFoundError:
        raise UserError(f"{what} {p} does not exist") from None
    except IsADirectoryError:
        raise UserError(f"{what} {p} is a directory, not a file") from None
    except PermissionError:
        raise UserError(f"{what} {p} is not readable (permission denied)") from None
    except OSError as e:
        raise UserError(f"cannot read {what} {p}: {e.strerror or type(e).__name__}") from None


def read_text(path: str | Path, what: str) -> str:
    """The text of a UTF-8 file (a UTF-8 byte-order mark is dropped); a one-line UserError if it cannot be read
    or is not UTF-8."""
    data = read_bytes(path, what)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise UserError(f"{what} {path} is not UTF-8 text (byte 0x{data[e.start]:02x} on line {line}): save it "
                        f"as UTF-8") from None


def read_json(path: str | Path, what: str, kind: type = dict) -> Any:
    """The JSON value of a UTF-8 file, which must be a `kind` (dict: an object, list: an array); a one-line
    UserError otherwise."""
    text = read_text(path, what)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{what} {path} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    except RecursionError:
        raise UserError(f"{what} {path} nests JSON too deeply") from None
    if not isinstance(value, kind):
        raise UserError(f"{what} {path} holds a JSON {json_type(value)}, expected a JSON {json_type(kind())}")
    return value


_JSON_TYPES = {dict: "object", list: "array", str: "string", int: "number", float: "number", bool: "boolean",
               type(None): "null"}


def json_type(value: Any) -> str:
    """The JSON name of a parsed value's type (object, array, string, number, boolean, null)."""
    return _JSON_TYPES.get(type(value), type(value).__name__)
