"""Where the builder keeps what outlives one run (calibration results, TensorRT timing caches)."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    return Path(os.environ.get("TRTBUILD_CACHE", ".cache/trtbuild"))
