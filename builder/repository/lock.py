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
from collections.abc import Callable, Iterator
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


class LockBusy(Exception):
    """The lock was not free within the wait allowed."""


@contextlib.contextmanager
def exclusive(path: Path, *, wait_s: float | None, poll_s: float = _POLL_S,
              on_busy: Callable[[], None] | None = None) -> Iterator[int]:
    """Hold an exclusive flock on `path` (created if missing); yield its descriptor.

    wait_s: None waits as long as it takes, 0 not at all; LockBusy when the lock stays taken.
    on_busy runs once, the first time the lock is found taken (to say whom we wait for).
    OSError from creating the file is the caller's to name."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = None if wait_s is None else time.monotonic() + wait_s
        announced = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if deadline is not None and time.monotonic() >= deadline:
                    raise LockBusy(str(path)) from None
                if on_busy is not None and not announced:
                    on_busy()
                    announced = True
                time.sleep(poll_s)
        yield fd
    finally:
        os.close(fd)  # closing the descriptor releases the lock


@contextlib.contextmanager
def repository_lock(repository: Path, *, what: str, wait: bool = True,
                    timeout_s: float | None = None) -> Iterator[None]:
    """Hold the repository's write lock; wait for the current holder (saying so) or fail at once."""
    path = repository / LOCK_FILE
    with contextlib.ExitStack() as stack:
        try:
            repository.mkdir(parents=True, exist_ok=True)
            fd = stack.enter_context(exclusive(
                path, wait_s=timeout_s if wait else 0,
                on_busy=lambda: log.warning("waiting for %s to finish writing %s", _holder(path), repository)))
        except LockBusy:
            if not wait:
                raise BuilderError(f"--repository {repository}: being written by {_holder(path)}; "
                                   "expected no other writer (run without --no-wait to wait for it)") from None
            raise BuilderError(f"--repository {repository}: still written by {_holder(path)} after "
                               f"{timeout_s:.0f} s") from None
        except OSError as exc:
            raise BuilderError(f"--repository {repository}: cannot create or lock it ({exc.strerror or exc})"
                               ) from exc
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "what": what, "command": " ".join(sys.argv[:4]),
                                  "since_unix": round(time.time(), 3)}).encode(), 0)
        yield
