"""Atomic writes: whole files or none, the mode an ordinary open() gives, no temporary files left."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import BinaryIO

import pytest

from common import files
from common.files import copy_atomic, write_atomic, write_json


def test_written_files_have_the_umask_mode_and_no_leftovers(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        write_atomic(tmp_path / "a" / "config.pbtxt", "name: 'x'\n")
        write_json(tmp_path / "a" / "r.json", {"k": [1, None]})
        copy_atomic(tmp_path / "a" / "config.pbtxt", tmp_path / "b" / "copy.pbtxt")
    finally:
        os.umask(old)
    for path in (tmp_path / "a" / "config.pbtxt", tmp_path / "a" / "r.json", tmp_path / "b" / "copy.pbtxt"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert json.loads((tmp_path / "a" / "r.json").read_text()) == {"k": [1, None]}
    assert (tmp_path / "b" / "copy.pbtxt").read_text() == "name: 'x'\n"
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["config.pbtxt", "copy.pbtxt", "r.json"]


def test_a_failed_write_leaves_the_previous_file_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "model.onnx"
    write_atomic(target, b"old")

    def half_then_fail(handle: BinaryIO) -> None:
        handle.write(b"new, half written")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        files._write(target, half_then_fail)
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["model.onnx"]


def test_a_write_never_changes_the_process_umask(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The umask is process-wide: setting it, even for an instant, races with files other threads create."""
    calls: list[int] = []
    real_umask = os.umask

    def watched(mask: int) -> int:
        calls.append(mask)
        return real_umask(mask)

    old = real_umask(0o027)
    try:
        monkeypatch.setattr(os, "umask", watched)
        write_atomic(tmp_path / "a.txt", "x")
        write_json(tmp_path / "b.json", {})
        copy_atomic(tmp_path / "a.txt", tmp_path / "c.txt")
    finally:
        real_umask(old)
    assert calls == []
    for name in ("a.txt", "b.json", "c.txt"):  # still the mode an ordinary open() gives under that umask
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o640
