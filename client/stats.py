"""Per-request records → window summaries, and perf_analyzer's stability rule."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from client.server_stats import ServerBreakdown

if TYPE_CHECKING:
    from client.power import PowerFigures


@dataclass
class Records:
    """Columns of per-request outcomes (nanoseconds, monotonic clock); filled by the load engine."""

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


@dataclass(frozen=True)
class Latency:
    """Request latency in µs, counted from the scheduled send time."""

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
    computed from the records alone (a LevelResult carries those over its summary separately).
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

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


# A send counts as late when it left this long after its scheduled time (open loop).
LATE_NS = 1_000_000


def latency_summary(latencies_ns: NDArray[Any]) -> Latency | None:
    if latencies_ns.size == 0:
        return None
    us = latencies_ns / 1e3
    p50, p90, p95, p99 = (float(v) for v in np.percentile(us, [50, 90, 95, 99], method="linear"))
    return Latency(avg=float(np.mean(us)), p50=p50, p90=p90, p95=p95, p99=p99, max=float(np.max(us)))


def summarize(records: Records, start_ns: int, end_ns: int, batch: int) -> Window:
    """Requests that completed in [start_ns, end_ns); latency counts from the scheduled send time."""
    done = np.asarray(records.done, dtype=np.int64)
    scheduled = np.asarray(records.scheduled, dtype=np.int64)
    sent = np.asarray(records.sent, dtype=np.int64)
    in_window = (done >= start_ns) & (done < end_ns)
    failed = np.asarray([e is not None for e in records.errors], dtype=bool)
    errors = [e for e, keep in zip(records.errors, in_window, strict=True) if keep and e is not None]
    ok = in_window & ~failed
    requests = int(np.count_nonzero(ok))
    seconds = max(end_ns - start_ns, 1) / 1e9
    return Window(
        start_ns=start_ns,
        end_ns=end_ns,
        requests=requests,
        inferences=requests * batch,
        throughput=requests * batch / seconds,
        latency_us=latency_summary(done[ok] - scheduled[ok]),
        errors=dict(Counter(errors)),
        late_sends=int(np.count_nonzero((sent[in_window] - scheduled[in_window]) > LATE_NS)),
    )


def is_stable(windows: Sequence[Window], percentage: float, count: int = 3) -> bool:
    """perf_analyzer's rule: the last `count` windows' throughput and average latency all lie
    within ±percentage % of their mean, and none is empty."""
    if len(windows) < count:
        return False
    last = windows[-count:]
    latencies = [w.latency_us.avg for w in last if w.latency_us is not None]
    if any(w.requests == 0 for w in last) or len(latencies) < count:
        return False
    for values in ([w.throughput for w in last], latencies):
        mean = sum(values) / len(values)
        if mean <= 0 or any(abs(v - mean) > mean * percentage / 100 for v in values):
            return False
    return True
