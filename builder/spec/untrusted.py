"""Files we did not necessarily write: build.json, tuned.toml, config.pbtxt and a repository's folders.

A model repository may come from someone else (copied, unpacked, mounted), and a python-backend folder
is code Triton runs. What we read from one is bounded in size, names are checked before they become
paths, a relative path never leaves its root, and a symlink is followed only when it resolves inside
that root. A refusal is one line naming the file and what is wrong with it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path, PurePosixPath

from builder.errors import BuilderError

MAX_RECORD_BYTES = 1 << 20  # build.json: hashes, versions, shapes (a few KB in practice)
MAX_TUNED_BYTES = 1 << 20  # tuned.toml: one small table per model
MAX_CONFIG_BYTES = 4 << 20  # config.pbtxt: Triton's own limit is far larger; ours hold a few KB
MAX_TREE_ENTRIES = 200_000  # files and folders walked in a repository before giving up


class UnsafeInput(BuilderError):
    """A file or folder we did not write would make us read too much or outside where it belongs."""


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def _resolve(path: Path, label: str) -> Path:
    """path with its symlinks resolved; a symlink loop is refused (Python 3.11 raises RuntimeError)."""
    try:
        return path.resolve()
    except (RuntimeError, OSError) as exc:
        raise UnsafeInput(f"{label}: a symlink loop ({exc})") from exc


def inside(root: Path, relative: str, what: str) -> Path:
    """root/relative, refused unless `relative` is a plain relative path that stays inside root once
    symlinks are resolved."""
    if not relative or "\0" in relative:
        raise UnsafeInput(f"{what} {relative!r}: expected a relative path")
    pure = PurePosixPath(relative)
    if pure.is_absolute() or ".." in pure.parts:
        raise UnsafeInput(f"{what} {relative!r}: expected a path inside {root}, without '..'")
    base = _resolve(root, str(root))
    resolved = _resolve(base / pure, f"{what} {relative!r}")
    if not _inside(resolved, base):
        raise UnsafeInput(f"{what} {relative!r}: resolves to {resolved}, outside {root}")
    return resolved


def read_text(path: Path, *, limit: int, root: Path | None = None, what: str | None = None) -> str:
    """A regular file's text, at most `limit` bytes; with `root`, only when the file (after symlinks)
    lies inside it. OSError as open() raises it when the file is missing or unreadable."""
    label = what or str(path)
    resolved = _resolve(path, label)
    if root is not None and not _inside(resolved, _resolve(root, str(root))):
        raise UnsafeInput(f"{label}: a symlink to {resolved}, outside {root}")
    # O_NONBLOCK: opening a FIFO (or a device) must not wait for a writer; a regular file ignores it.
    fd = os.open(resolved, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise UnsafeInput(f"{label}: not a regular file")
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise UnsafeInput(f"{label}: over {limit} bytes; not a file this tool wrote")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UnsafeInput(f"{label}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc


def check_tree(root: Path, *, limit: int = MAX_TREE_ENTRIES) -> int:
    """Walk root without following symlinks; refuse a symlink that resolves outside root, and a tree of
    more than `limit` entries. Returns the number of entries."""
    base = _resolve(root, str(root))
    count = 0
    pending = [base]
    while pending:
        folder = pending.pop()
        try:
            entries = list(os.scandir(folder))
        except OSError as exc:
            raise UnsafeInput(f"{folder}: cannot list ({exc.strerror or exc})") from exc
        for entry in entries:
            count += 1
            if count > limit:
                raise UnsafeInput(f"{root}: over {limit} files and folders; not a model repository")
            path = Path(entry.path)
            if entry.is_symlink():
                target = _resolve(path, f"{path} in the repository {root}")
                if not _inside(target, base):
                    raise UnsafeInput(f"{path}: a symlink to {target}, outside the repository {root}; "
                                      "copy what it points at into the repository instead")
            elif entry.is_dir(follow_symlinks=False):
                pending.append(path)
    return count
