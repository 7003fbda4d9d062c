"""What a CLI's main() sets for the whole process (the progress mode, logging's levels and handlers, warnings
capture), saved before a test and put back after it."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from common import progress
from common.logs import close_log_file


@contextmanager
def restored(package: str) -> Iterator[None]:
    """Progress off and logging as it was (the root logger and `package`'s) once the block ends; the log file
    a CLI opened is closed."""
    root, ours = logging.getLogger(), logging.getLogger(package)
    saved = (root.level, ours.level, root.handlers[:])
    try:
        yield
    finally:
        close_log_file()
        progress.configure(progress.Mode.OFF)
        logging.captureWarnings(False)
        root.setLevel(saved[0])
        ours.setLevel(saved[1])
        root.handlers[:] = saved[2]


@pytest.fixture(autouse=True)
def cli_progress_restored(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """For a test module that runs a CLI's main() (import it there): the CLIs choose progress by the terminal
    (tests/conftest.py turns it off through the environment, removed here); afterwards progress is off and
    logging as it was."""
    monkeypatch.delenv(progress.ENV, raising=False)
    with restored("client"):
        yield
