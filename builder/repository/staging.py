"""Atomic writes into a Triton model repository.

Variants are built in a staging folder inside the repository (same filesystem, so renames are
atomic) and swapped in only once every model of the run has passed; a failed run leaves every
existing model exactly as it was.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from builder.errors import BuilderError

log = logging.getLogger(__name__)

_STAGING_PREFIX = ".staging-"
_TRASH_PREFIX = ".trash-"


class Staging:
    """A staging area for one build run: `dir(name)` gives a fresh folder, `commit()` swaps them in."""

    def __init__(self, repository: Path) -> None:
        self.repository = repository
        try:
            repository.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise BuilderError(f"--repository {repository}: cannot create the folder ({exc})") from exc
        if not os.access(repository, os.W_OK):
            raise BuilderError(f"--repository {repository}: folder is not writable")
        self._clear_leftovers()
        self.root = Path(tempfile.mkdtemp(prefix=_STAGING_PREFIX, dir=repository))
        self._names: list[str] = []

    def _clear_leftovers(self) -> None:
        # A crashed earlier run may have left a staging or trash folder; neither holds a live model.
        for child in self.repository.iterdir():
            if child.name.startswith((_STAGING_PREFIX, _TRASH_PREFIX)) and child.is_dir():
                shutil.rmtree(child, ignore_errors=True)

    def dir(self, name: str) -> Path:
        path = self.root / name
        if path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True)
        self._names.append(name)
        return path

    def commit(self) -> list[Path]:
        """Swap staged models into the repository, each with one rename; return their final paths."""
        committed = []
        for name in self._names:
            staged = self.root / name
            final = self.repository / name
            trash = None
            if final.exists():
                trash = self.repository / f"{_TRASH_PREFIX}{name}-{os.getpid()}"
                os.replace(final, trash)
            os.replace(staged, final)
            if trash is not None:
                shutil.rmtree(trash, ignore_errors=True)
            committed.append(final)
            log.info("wrote %s", final)
        return committed

    def discard(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
