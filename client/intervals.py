"""`--request-intervals FILE`: replay a recorded arrival pattern, open loop.

perf_analyzer's format: one time interval in microseconds per line, the gap before the next request.
The list repeats until the measurement ends. Latency counts from each request's scheduled time (as for
`--request-rate`), so a client that falls behind the file shows it in the latency, not in a thinner load.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from client.errors import PerfClientError

FLAG = "--request-intervals"
# A file this long is a mistake (or not an interval file); the replay holds it in memory.
MAX_INTERVALS = 10_000_000


@dataclass(frozen=True)
class RequestIntervals:
    """The gaps between consecutive sends, in microseconds, as the file gives them."""

    path: Path
    intervals_us: tuple[int, ...]

    @property
    def rate(self) -> float:
        """Mean requests per second over one pass through the file."""
        return len(self.intervals_us) * 1e6 / sum(self.intervals_us)

    def gaps_ns(self) -> Iterator[float]:
        """The gaps in ns, the file repeated without end."""
        return itertools.cycle([us * 1e3 for us in self.intervals_us])

    def __str__(self) -> str:
        return f"intervals {self.path.name}"


def load_intervals(path: Path) -> RequestIntervals:
    """Read `path`; PerfClientError naming the file (and the line) when it is not a list of intervals."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PerfClientError(f"{FLAG} {path}: file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise PerfClientError(f"{FLAG} {path}: cannot read it ({exc})") from exc
    intervals = []
    for number, line in enumerate(text.splitlines(), start=1):
        value = line.strip()
        if not value:
            continue  # blank lines (a trailing newline, an empty last line)
        if not (value.isascii() and value.isdigit()):
            raise PerfClientError(f"{FLAG} {path}:{number}: {value[:40]!r} is not a whole number of microseconds")
        intervals.append(int(value))
        if len(intervals) > MAX_INTERVALS:
            raise PerfClientError(f"{FLAG} {path}: more than {MAX_INTERVALS} intervals")
    if not intervals:
        raise PerfClientError(f"{FLAG} {path}: no intervals (expected one number of microseconds per line)")
    if sum(intervals) == 0:
        raise PerfClientError(f"{FLAG} {path}: every interval is 0; expected at least one positive interval")
    return RequestIntervals(path, tuple(intervals))
