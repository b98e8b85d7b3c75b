"""Files: atomic writes reach the disk (file and directory fsynced) and leave nothing half-written; text and JSON
readers turn every unreadable file into one line."""

from __future__ import annotations

import os
import re

import pytest

from mlx_redrafter import files
from mlx_redrafter.errors import UserError


def test_write_atomic_fsyncs_the_file_and_its_directory(tmp_path, monkeypatch):
    synced: list[str] = []
    real = os.fsync

    def spy(fd):
        synced.append("dir" if os.path.isdir(f"/proc/self/fd/{fd}") else "file")
        return real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    path = files.write_atomic(tmp_path / "sub" / "a.json", "{}\n")
    assert path.read_text() == "{}\n" and oct(path.stat().st_mode & 0o777) == "0o644"
    assert synced == ["file", "dir"]  # the data before the rename, the rename after it
    assert sorted(p.name for p in path.parent.iterdir()) == ["a.json"]  # no temp file left


def test_write_atomic_keeps_the_old_file_when_the_write_fails(tmp_path, monkeypatch):
    path = files.write_atomic(tmp_path / "a.txt", "old")

    def broken(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", broken)
    with pytest.raises(UserError, match="cannot write .*a.txt: No space left on device"):
        files.write_atomic(path, "new")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["a.txt"]


@pytest.mark.parametrize("target,needle", [("adir", "is a directory: give a file path"),
                                           ("afile/x", "afile is a file, not a directory"),
                                           ("afile/sub/x", "afile is a file, not a directory")])
def test_write_atomic_refuses_a_path_it_cannot_write(tmp_path, target, needle):
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("keep")
    with pytest.raises(UserError, match=re.escape(needle)):
        files.write_atomic(tmp_path / target, "new")
    assert (tmp_path / "afile").read_text() == "keep" and sorted(p.name for p in tmp_path.iterdir()) == [
        "adir", "afile"]
    with pytest.raises(UserError, match="afile is a file"):
        files.check_writable_dir(tmp_path / "afile", "--out")
    files.check_writable_dir(tmp_path / "new" / "deeper", "--out")  # absent parents are fine


@pytest.mark.parametrize("make,needle", [
    (lambda p: p.write_bytes(b"caf\xe9\n"), "not UTF-8 text (byte 0xe9 on line 1)"),
    (lambda p: p.mkdir(), "is a directory"),
    (lambda p: None, "does not exist"),
])
def test_read_text_errors_are_one_line(tmp_path, make, needle):
    p = tmp_path / "x.txt"
    make(p)
    with pytest.raises(UserError, match=re.escape(needle)) as e:
        files.read_text(p, "notes file")
    assert str(e.value).startswith("notes file") and "\n" not in str(e.value)


def test_read_text_drops_a_byte_order_mark(tmp_path):
    p = tmp_path / "x.json"
    p.write_bytes(b"\xef\xbb\xbf{\"a\": 1}")
    assert files.read_json(p, "config") == {"a": 1}


@pytest.mark.parametrize("data,kind,needle", [
    (b"[1]", dict, "holds a JSON array, expected a JSON object"),
    (b"{}", list, "holds a JSON object, expected a JSON array"),
    (b'{"a": }', dict, "not valid JSON (Expecting value at line 1, column 7)"),
    (b"[" * 100_000, list, "nests JSON too deeply"),
])
def test_read_json_errors_are_one_line(tmp_path, data, kind, needle):
    p = tmp_path / "x.json"
    p.write_bytes(data)
    with pytest.raises(UserError, match=re.escape(needle)):
        files.read_json(p, "manifest", kind)


def test_output_checks_refuse_empty_paths_special_files_and_unwritable_places(tmp_path):
    with pytest.raises(UserError, match="--out is empty: give a path"):
        files.check_writable_file("", "--out")
    with pytest.raises(UserError, match="is not a regular file"):
        files.check_writable_file("/dev/null", "--out")
    for check in (files.check_writable_file, files.check_writable_dir):
        with pytest.raises(UserError, match="/proc/x cannot be written"):
            check("/proc/x", "--out")
    assert sorted(tmp_path.iterdir()) == []  # the probe file is gone
    files.check_writable_dir(tmp_path, "--out")
    assert sorted(tmp_path.iterdir()) == []
