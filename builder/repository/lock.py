"""One writer at a time per model repository: an OS file lock (flock) that every writer takes
(builds, tune's winner), with who holds it recorded beside it so a waiter can say whom it waits for.

flock is released by the kernel when its holder dies, so a crashed build never leaves the
repository locked.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from builder.errors import BuilderError

log = logging.getLogger(__name__)

LOCK_FILE = ".trtbuild.lock"
_POLL_S = 0.5


def _holder(path: Path) -> str:
    try:
        info = json.loads(path.read_text(encoding="utf-8") or "{}")
        return f"{info.get('what', 'another writer')} (pid {info.get('pid', '?')}, {info.get('command', '?')})"
    except (OSError, ValueError):
        return "another writer"


@contextlib.contextmanager
def repository_lock(repository: Path, *, what: str, wait: bool = True,
                    timeout_s: float | None = None) -> Iterator[None]:
    """Hold the repository's write lock; wait for the current holder (saying so) or fail at once."""
    path = repository / LOCK_FILE
    try:
        repository.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise BuilderError(f"--repository {repository}: cannot create or lock it ({exc.strerror or exc})") from exc
    try:
        started = time.monotonic()
        announced = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = _holder(path)
                if not wait:
                    raise BuilderError(f"--repository {repository}: being written by {holder}; "
                                       "expected no other writer (run without --no-wait to wait for it)") from None
                if timeout_s is not None and time.monotonic() - started > timeout_s:
                    raise BuilderError(f"--repository {repository}: still written by {holder} after "
                                       f"{timeout_s:.0f} s") from None
                if not announced:
                    log.warning("waiting for %s to finish writing %s", holder, repository)
                    announced = True
                time.sleep(_POLL_S)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "what": what, "command": " ".join(sys.argv[:4]),
                                  "since_unix": round(time.time(), 3)}).encode(), 0)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock
