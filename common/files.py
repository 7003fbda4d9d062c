"""Atomic file writes, the one helper both packages use: readers never see half a file.

A unique temporary file in the target's own folder (so the rename is atomic and two writers on a
shared volume never share a temporary name), fsync'd, then renamed over the target.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def _create_temporary(path: Path) -> tuple[int, str]:
    """A new, uniquely named file beside `path`, created with mode 0666 for the kernel to apply the umask
    to: the mode an ordinary open() gives (readers may be other users). mkstemp's 0600 would need a chmod
    to the umask, and reading the umask means setting it, process-wide, racing with other threads."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    while True:
        tmp = str(path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp")
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:  # another writer's name: draw again
            continue


def _write(path: Path, fill: Callable[[BinaryIO], None], *, stat_from: Path | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _create_temporary(path)
    try:
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
