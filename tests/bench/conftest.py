"""What the bench tests share: bench/gpu/bench_ort.py loaded as a module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from tests.helpers.scripts import loaded_script

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench_ort() -> Iterator[ModuleType]:
    with loaded_script("bench_ort", ROOT / "bench" / "gpu" / "bench_ort.py") as module:
        yield module
