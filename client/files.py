"""Atomic file writes, the one helper both packages use: readers never see half a file.

A unique temporary file in the target's own folder (so the rename is atomic and two writers on a
shared volume never share a temporary name), fsync'd, then renamed over the target.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _write(path: Path, fill: Callable[[BinaryIO], None], *, stat_from: Path | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        # mkstemp creates 0600; give the file the mode an ordinary open() would (readers may be other users).
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as handle:
            fill(handle)
            handle.flush()
            os.fsync(handle.fileno())
        if stat_from is not None:
            shutil.copystat(stat_from, tmp)  # mode (an executable stays one) and times
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_atomic(path: Path, data: bytes | str) -> None:
    payload = data.encode("utf-8") if isinstance(data, str) else data

    def fill(handle: BinaryIO) -> None:
        handle.write(payload)

    _write(path, fill)


def copy_atomic(source: Path, path: Path, *, keep_stat: bool = False) -> None:
    """Copy a file so that `path` appears whole or not at all (streamed: model files are large).

    The rename never writes into the old `path`, so it works even where a process executes it (writing
    over a running executable fails with ETXTBSY). keep_stat: the copy gets source's mode and times."""
    with source.open("rb") as reader:

        def fill(handle: BinaryIO) -> None:
            shutil.copyfileobj(reader, handle, 1 << 20)

        _write(path, fill, stat_from=source if keep_stat else None)


def write_json(path: Path, payload: object) -> None:
    write_atomic(path, json.dumps(payload, indent=2, default=str) + "\n")
