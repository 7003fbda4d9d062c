"""Peak memory as build.json records it per step.

`resource.getrusage(RUSAGE_SELF).ru_maxrss` is the process's high-water mark (KiB on Linux, bytes on macOS):
it never goes down, so read after a step it is the peak *so far*, and a step that raised it is the one that
needed more than every step before it. The quantizer subprocess (ONNX Runtime's recipe) is counted apart,
through RUSAGE_CHILDREN (the largest child that has ended); Linux counts in a child the memory it had between
fork and exec, i.e. this process's RSS at the time, so that figure is at least the parent's RSS when it started
the child and says something of its own only where it is larger. A figure the platform does not give is None.
"""

from __future__ import annotations

import ctypes
import resource
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


def release_free_memory() -> None:
    """Give the heap memory this process has freed back to the system (glibc's malloc_trim), where the C library
    has it. Why: glibc keeps freed blocks for reuse, so after an FP16 conversion the build held 1.2 GB it no
    longer used while the quantizer subprocess ran beside it; the machine's peak is the two together."""
    if not sys.platform.startswith("linux"):
        return
    try:
        trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # the process's own symbols: its C library's
    except OSError:
        return
    if trim is not None:  # musl has none
        trim(0)


def _mib(maxrss: int) -> float:
    return round(maxrss / (1024 * 1024 if sys.platform == "darwin" else 1024), 1)


def peak_rss_mib() -> float | None:
    """This process's peak resident set size so far, MiB."""
    try:
        return _mib(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    except (OSError, ValueError):
        return None


def children_peak_rss_mib() -> float | None:
    """The largest peak RSS of the child processes that have ended (the quantizer subprocess), MiB."""
    try:
        value = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    except (OSError, ValueError):
        return None
    return _mib(value) if value else None


@dataclass
class StepFigures:
    """One step: its wall time, and the process's peak RSS so far when it ended (monotonic; see the module)."""

    step: str
    seconds: float = 0.0
    peak_rss_mib: float | None = None
    children_peak_rss_mib: float | None = None


@dataclass
class StepLog:
    steps: list[StepFigures] = field(default_factory=list)

    @contextmanager
    def step(self, name: str) -> Iterator[StepFigures]:
        figures = StepFigures(name)
        started = time.perf_counter()
        try:
            yield figures
        finally:
            figures.seconds = round(time.perf_counter() - started, 3)
            figures.peak_rss_mib = peak_rss_mib()
            figures.children_peak_rss_mib = children_peak_rss_mib()
            self.steps.append(figures)
