"""Writing files safely: never a half-written file (temp file in the same folder, then rename)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomic(path: str | Path, data: str | bytes, mode: int = 0o644) -> Path:
    """Write `data` to `path` via a temp file in the same directory and an atomic rename; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.chmod(tmp, mode)  # mkstemp creates 0600
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def fsync_tree(folder: str | Path, files: bool = True) -> None:
    """Flush a directory's files (with `files`) and the directory itself to disk."""
    folder = Path(folder)
    if files:
        for f in folder.iterdir():
            if f.is_file() and not f.is_symlink():
                with f.open("rb") as fh:
                    os.fsync(fh.fileno())
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
