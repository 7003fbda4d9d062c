"""File-tree helpers shared by tests."""

from __future__ import annotations

import hashlib
from pathlib import Path


def snapshot(root: Path) -> dict[str, str]:
    """Every file under root with its content hash: equal snapshots mean nothing changed."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}
