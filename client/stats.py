"""Per-window statistics accumulated as requests complete, and perf_analyzer's definitions.

The load engine adds each outcome to the open window's `Tally` (O(1) per request); at a window
boundary the tally is swapped for a fresh one and summarized once. Nothing ever rescans the whole
run. A summary over several windows merges their latency arrays exactly, as perf_analyzer's
`MergePerfStatusReports` does, so worker processes' windows merge the same way.
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from client.server_stats import ServerBreakdown

if TYPE_CHECKING:
    from client.power import PowerFigures

PERCENTILES = (50, 90, 95, 99)


@dataclass
class Records:
    """Every request's timestamps (ns, monotonic) and outcome: an optional trace a LoadRun keeps when
    asked (`keep_records=True`), for checking its windows against; the statistics never read it."""

    scheduled: list[int] = field(default_factory=list)
    sent: list[int] = field(default_factory=list)
    done: list[int] = field(default_factory=list)
    errors: list[str | None] = field(default_factory=list)

    def add(self, scheduled: int, sent: int, done: int, error: str | None) -> None:
        self.scheduled.append(scheduled)
        self.sent.append(sent)
        self.done.append(done)
        self.errors.append(error)

    def __len__(self) -> int:
        return len(self.done)


class StreamTally:
    """A window's streamed requests (--streaming, successful ones): time to the first response, the times between
    responses, and each request's number of responses (ns)."""

    __slots__ = ("first_ns", "gaps_ns", "responses")

    def __init__(self) -> None:
        self.first_ns = array("q")
        self.gaps_ns = array("q")
        self.responses = array("q")

    def add(self, first_ns: int | None, gaps_ns: Sequence[int], responses: int) -> None:
        if first_ns is not None:
            self.first_ns.append(first_ns)
        self.gaps_ns.extend(gaps_ns)
        self.responses.append(responses)


@dataclass(frozen=True)
class StreamFigures:
    """Streamed requests' figures over a window or a summary: first-response latency and inter-response time
    (µs, None when no request had one), responses per request (mean; None without a request)."""

    first_response_us: Latency | None
    inter_response_us: Latency | None
    responses_per_request: float | None
    first_ns: NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, np.int64), repr=False, compare=False)
    gaps_ns: NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, np.int64), repr=False, compare=False)
    responses: NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, np.int64), repr=False, compare=False)


def stream_figures(first_ns: NDArray[Any], gaps_ns: NDArray[Any], responses: NDArray[Any]) -> StreamFigures:
    first, gaps = np.sort(first_ns.astype(np.int64)), np.sort(gaps_ns.astype(np.int64))
    counts = responses.astype(np.int64)
    return StreamFigures(latency_summary(first), latency_summary(gaps),
                         float(np.mean(counts)) if counts.size else None, first, gaps, counts)


def _stream_close(tally: StreamTally | None) -> StreamFigures | None:
    if tally is None:
        return None
    return stream_figures(*(np.frombuffer(a, dtype=np.int64) if a else np.zeros(0, np.int64)
                            for a in (tally.first_ns, tally.gaps_ns, tally.responses)))


def _stream_merge(windows: Sequence[Window]) -> StreamFigures | None:
    streams = [w.stream for w in windows if w.stream is not None]
    if not streams:
        return None
    return stream_figures(np.concatenate([s.first_ns for s in streams]), np.concatenate([s.gaps_ns for s in streams]),
                          np.concatenate([s.responses for s in streams]))


class Tally:
    """One window's outcomes as they arrive: successful latencies, errors by kind, send lag; streamed requests'
    response timings (`stream`, --streaming only)."""

    __slots__ = ("dropped", "errors", "late", "latencies", "max_lag_ns", "retries", "stream")

    def __init__(self) -> None:
        self.latencies = array("q")  # ns, successful requests only
        self.errors: Counter[str] = Counter()
        self.late = 0
        self.dropped = 0
        self.max_lag_ns: int | None = None  # open loop only
        self.retries = 0  # requests the transport sent once more (client.protocol.Connection.retries)
        self.stream: StreamTally | None = None

    def ok(self, latency_ns: int) -> None:
        self.latencies.append(latency_ns)

    def streamed(self, first_ns: int | None, gaps_ns: Sequence[int], responses: int) -> None:
        """A successful streamed request's response timings (its latency goes through `ok`)."""
        if self.stream is None:
            self.stream = StreamTally()
        self.stream.add(first_ns, gaps_ns, responses)

    def failed(self, kind: str) -> None:
        self.errors[kind] += 1

    def lag(self, lag_ns: int, *, late: bool) -> None:
        """An open-loop send that left `lag_ns` after its scheduled time."""
        if self.max_lag_ns is None or lag_ns > self.max_lag_ns:
            self.max_lag_ns = lag_ns
        if late:
            self.late += 1

    @property
    def completed(self) -> int:
        return len(self.latencies) + sum(self.errors.values())


@dataclass(frozen=True)
class Latency:
    """Request latency in µs (closed loop: from the send; open loop: from the scheduled send time)."""

    avg: float
    p50: float
    p90: float
    p95: float
    p99: float
    max: float


@dataclass(frozen=True)
class Window:
    """What the client saw in one interval; the engine adds the server's and the meter's view of it.

    `latency_us` is None when no request succeeded; `server` and `power` are None for a summary
    computed from the client's figures alone (a LevelResult carries those over its summary separately).
    `max_send_lag_us` is None in closed loop (sends are not scheduled there).
    """

    start_ns: int
    end_ns: int
    requests: int  # successful requests
    inferences: int
    throughput: float  # inferences per second
    latency_us: Latency | None
    errors: dict[str, int]  # error kind -> count
    late_sends: int = 0
    server: ServerBreakdown | None = None
    power: PowerFigures | None = None
    dropped_sends: int = 0
    max_send_lag_us: float | None = None
    retries: int = 0  # requests sent again by the transport: refused unprocessed (GOAWAY, REFUSED_STREAM), idle close
    stream: StreamFigures | None = None  # --streaming: response timings of the successful requests
    # Sorted successful latencies (ns): what summaries over several windows merge.
    latencies_ns: NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, np.int64), repr=False, compare=False)

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


def nearest_rank(sorted_ns: NDArray[Any], percentile: int) -> int:
    """perf_analyzer's percentile: the sorted value at index (p/100)·(n−1) + 0.5, truncated."""
    index = int((percentile / 100.0) * (len(sorted_ns) - 1) + 0.5)
    return int(sorted_ns[index])


def latency_summary(sorted_ns: NDArray[Any]) -> Latency | None:
    """avg, nearest-rank p50/p90/p95/p99 and max (µs) of sorted latencies in ns; None when empty."""
    if sorted_ns.size == 0:
        return None
    p50, p90, p95, p99 = (nearest_rank(sorted_ns, p) / 1e3 for p in PERCENTILES)
    return Latency(avg=float(np.mean(sorted_ns)) / 1e3, p50=p50, p90=p90, p95=p95, p99=p99,
                   max=float(sorted_ns[-1]) / 1e3)


def close(tally: Tally, start_ns: int, end_ns: int, batch: int) -> Window:
    """A window's summary from its tally: requests that completed in [start_ns, end_ns)."""
    latencies = np.sort(np.frombuffer(tally.latencies, dtype=np.int64)) if tally.latencies else np.zeros(0, np.int64)
    requests = int(latencies.size)
    seconds = max(end_ns - start_ns, 1) / 1e9
    return Window(
        start_ns=start_ns, end_ns=end_ns, requests=requests, inferences=requests * batch,
        throughput=requests * batch / seconds, latency_us=latency_summary(latencies), errors=dict(tally.errors),
        late_sends=tally.late, dropped_sends=tally.dropped, retries=tally.retries,
        max_send_lag_us=tally.max_lag_ns / 1e3 if tally.max_lag_ns is not None else None, latencies_ns=latencies,
        stream=_stream_close(tally.stream),
    )


def merge(windows: Sequence[Window], batch: int) -> Window:
    """One summary over consecutive windows: latencies pooled and re-sorted, counts summed, throughput
    over their summed durations (perf_analyzer's merged report). Windows must not be empty."""
    if not windows:
        raise ValueError("merge() needs at least one window")
    latencies = np.sort(np.concatenate([w.latencies_ns for w in windows]))
    requests = int(latencies.size)
    seconds = max(sum(w.end_ns - w.start_ns for w in windows), 1) / 1e9
    errors: Counter[str] = Counter()
    for w in windows:
        errors.update(w.errors)
    lags = [w.max_send_lag_us for w in windows if w.max_send_lag_us is not None]
    return Window(
        start_ns=windows[0].start_ns, end_ns=windows[-1].end_ns, requests=requests, inferences=requests * batch,
        throughput=requests * batch / seconds, latency_us=latency_summary(latencies), errors=dict(errors),
        late_sends=sum(w.late_sends for w in windows), dropped_sends=sum(w.dropped_sends for w in windows),
        retries=sum(w.retries for w in windows),
        max_send_lag_us=max(lags) if lags else None, latencies_ns=latencies, stream=_stream_merge(windows),
    )


def is_stable(windows: Sequence[Window], percentage: float, count: int = 3) -> bool:
    """perf_analyzer's rule: over the last `count` windows, none empty, max/min of throughput and of
    average latency each at most 1 + percentage/100."""
    if len(windows) < count:
        return False
    last = windows[-count:]
    if any(w.requests == 0 or w.latency_us is None for w in last):
        return False
    bound = 1 + percentage / 100
    for values in ([w.throughput for w in last], [w.latency_us.avg for w in last if w.latency_us is not None]):
        if min(values) <= 0 or max(values) / min(values) > bound:
            return False
    return True
