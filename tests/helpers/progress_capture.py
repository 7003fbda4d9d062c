"""Plain progress lines captured in memory, for tests that read what a step reports."""

from __future__ import annotations

import io
from collections.abc import Iterator
from contextlib import contextmanager

from common import progress


@contextmanager
def plain_progress(interval: float) -> Iterator[io.StringIO]:
    """Progress in plain mode into a string buffer (`interval`: seconds between a task's [....] lines); off
    again afterwards."""
    stream = io.StringIO()
    progress.configure(progress.Mode.PLAIN, stream=stream, interval=interval)
    try:
        yield stream
    finally:
        progress.configure(progress.Mode.OFF)
