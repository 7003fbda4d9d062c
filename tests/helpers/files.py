"""File-tree helpers shared by tests."""

from __future__ import annotations

import hashlib
from pathlib import Path

from builder.repository.lock import LOCK_FILE


def snapshot(root: Path) -> dict[str, str]:
    """Every file under root with its content hash: equal snapshots mean no model changed. The
    repository's lock file is not a model: every writer takes the lock, even one that then fails."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != LOCK_FILE}
