"""Fixtures of the serving tests that start servers from a state folder."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from builder.cli import main


@pytest.fixture
def one_model(repo_copy: Path) -> Path:
    """The tiny repository cut to one model: one stub, a short start."""
    for child in repo_copy.iterdir():
        if child.is_dir() and child.name != "mlp_fp32":
            shutil.rmtree(child)
    return repo_copy


@pytest.fixture
def state(tmp_path: Path) -> Iterator[Path]:
    """A state folder whose server (if a test leaves one) is stopped afterwards."""
    folder = tmp_path / "run"
    yield folder
    main(["-q", "stop", "--state-dir", str(folder)])
