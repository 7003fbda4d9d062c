"""Atomic file writes, the one helper both packages use: readers never see half a file.

A unique temporary file in the target's own folder (so the rename is atomic and two writers on a
shared volume never share a temporary name), fsync'd, then renamed over the target.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path


def write_atomic(path: Path, data: bytes | str) -> None:
    payload = data.encode("utf-8") if isinstance(data, str) else data
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def copy_atomic(source: Path, path: Path) -> None:
    """Copy a file so that `path` appears whole or not at all."""
    write_atomic(path, source.read_bytes())


def write_json(path: Path, payload: object) -> None:
    write_atomic(path, json.dumps(payload, indent=2, default=str) + "\n")
