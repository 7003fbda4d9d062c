"""Atomic writes into a Triton model repository.

Variants are built in a staging folder inside the repository (same filesystem, so renames are
atomic) and swapped in one by one as each passes (`commit_one`), or all at once only when every model
of the run has passed (`commit`, for --all-or-nothing); a variant that fails leaves the repository's
copy of it exactly as it was. Staging lives only under the repository lock, so at the start of
a build every staging or trash folder present was left by a build that died, and is removed.

The swap exchanges the staged and the live folder in one `renameat2(RENAME_EXCHANGE)` call, so a
reader (Triton polling the repository) never finds the model folder missing. Where the filesystem
cannot exchange, it falls back to two renames and says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import shutil
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

from builder.errors import BuilderError

log = logging.getLogger(__name__)

_STAGING_PREFIX = ".staging-"
_TRASH_PREFIX = ".trash-"
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


@cache
def _renameat2() -> Any:
    """libc's renameat2 (glibc >= 2.28), or None."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    function = getattr(libc, "renameat2", None)
    if function is not None:
        function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        function.restype = ctypes.c_int
    return function


def exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths atomically; False where the OS or filesystem cannot."""
    function = _renameat2()
    if function is None:
        return False
    if function(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(code, f"exchanging {a} and {b}: {os.strerror(code)}")


def leftovers(repository: Path) -> list[Path]:
    """Staging and trash folders in the repository (Triton would try to load them as models)."""
    return sorted(p for p in repository.iterdir() if p.is_dir() and p.name.startswith((_STAGING_PREFIX, _TRASH_PREFIX)))


def clear_leftovers(repository: Path) -> list[Path]:
    """Remove every staging and trash folder, whoever made it. Only under the repository lock: then no
    other writer is running here, so each one is left by a build that died (this version's naming or
    an older one's)."""
    found = leftovers(repository)
    for child in found:
        log.warning("removing %s, left by a build that died", child)
        shutil.rmtree(child, ignore_errors=True)
    return found


class Staging:
    """A staging area for one build run: `dir(name)` gives a fresh folder, `commit()` swaps them in.
    Callers hold the repository lock (builder.repository.lock) around its whole life."""

    def __init__(self, repository: Path) -> None:
        self.repository = repository
        try:
            repository.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise BuilderError(f"--repository {repository}: cannot create the folder ({exc})") from exc
        if not os.access(repository, os.W_OK):
            raise BuilderError(f"--repository {repository}: folder is not writable")
        self._clear_leftovers()
        self.root = Path(tempfile.mkdtemp(prefix=f"{_STAGING_PREFIX}{os.getpid()}-", dir=repository))
        self._names: list[str] = []

    def _clear_leftovers(self) -> None:
        clear_leftovers(self.repository)

    def dir(self, name: str) -> Path:
        path = self.root / name
        if path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True)
        if name not in self._names:
            self._names.append(name)
        return path

    def commit(self) -> list[Path]:
        """Swap every staged model into the repository; return their final paths."""
        return [self.commit_one(name) for name in list(self._names)]

    def commit_one(self, name: str) -> Path:
        """Swap one staged model folder into the repository on its own (atomically where the filesystem
        can exchange folders); return its final path. The others stay staged."""
        staged = self.root / name
        final = self.repository / name
        if final.exists() and exchange(staged, final):
            shutil.rmtree(staged, ignore_errors=True)  # now the previous model
        else:
            if final.exists():
                log.warning("%s: this filesystem cannot exchange folders atomically; replacing it with "
                            "two renames (a reader may miss it for a moment)", final)
                trash = Path(tempfile.mkdtemp(prefix=f"{_TRASH_PREFIX}{os.getpid()}-", dir=self.repository))
                os.replace(final, trash / name)
                os.replace(staged, final)
                shutil.rmtree(trash, ignore_errors=True)
            else:
                os.replace(staged, final)
        self._names.remove(name)
        log.debug("wrote %s", final)
        return final

    def drop(self, name: str) -> None:
        """Forget a staged model folder (a variant that failed): the repository's copy, if any, stays."""
        shutil.rmtree(self.root / name, ignore_errors=True)
        if name in self._names:
            self._names.remove(name)

    def discard(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
