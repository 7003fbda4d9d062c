"""Per-request records → window summaries, perf_analyzer-compatible stability, server-side deltas."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from client.protocol import ServerStats


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
class Window:
    start_ns: int
    end_ns: int
    requests: int
    inferences: int
    throughput: float  # inferences per second
    latency_us: dict[str, float]
    errors: dict[str, int]
    late_sends: int = 0
    server: dict[str, float] | None = None
    power: dict[str, object] | None = None

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


_PERCENTILES = {"p50": 50, "p90": 90, "p95": 95, "p99": 99}
# A send counts as late when it left this long after its scheduled time (open loop).
LATE_NS = 1_000_000


def latency_summary(latencies_ns: NDArray[Any]) -> dict[str, float]:
    if latencies_ns.size == 0:
        return {k: 0.0 for k in ("avg", *_PERCENTILES, "max")}
    us = latencies_ns / 1e3
    out = {"avg": float(np.mean(us))}
    for key, q in _PERCENTILES.items():
        out[key] = float(np.percentile(us, q, method="linear"))
    out["max"] = float(np.max(us))
    return out


def summarize(records: Records, start_ns: int, end_ns: int, batch: int, first: int = 0) -> Window:
    """Requests that completed in [start_ns, end_ns); latency counts from the scheduled send time."""
    done = np.asarray(records.done[first:], dtype=np.int64)
    scheduled = np.asarray(records.scheduled[first:], dtype=np.int64)
    sent = np.asarray(records.sent[first:], dtype=np.int64)
    in_window = (done >= start_ns) & (done < end_ns)
    errors = [e for e, keep in zip(records.errors[first:], in_window, strict=True) if keep and e is not None]
    ok = in_window & np.asarray([e is None for e in records.errors[first:]], dtype=bool)
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
    if any(w.requests == 0 for w in last):
        return False
    for values in ([w.throughput for w in last], [w.latency_us["avg"] for w in last]):
        mean = sum(values) / len(values)
        if mean <= 0 or any(abs(v - mean) > mean * percentage / 100 for v in values):
            return False
    return True


def server_breakdown(before: ServerStats, after: ServerStats) -> dict[str, float]:
    """Average server-side times per request (µs) and the achieved batch over an interval."""
    requests = after.success_count - before.success_count
    executions = after.execution_count - before.execution_count
    inferences = after.inference_count - before.inference_count

    def per_request(a: int, b: int) -> float:
        return (b - a) / requests / 1e3 if requests > 0 else 0.0

    return {
        "requests": float(requests),
        "queue_us": per_request(before.queue_ns, after.queue_ns),
        "compute_input_us": per_request(before.compute_input_ns, after.compute_input_ns),
        "compute_infer_us": per_request(before.compute_infer_ns, after.compute_infer_ns),
        "compute_output_us": per_request(before.compute_output_ns, after.compute_output_ns),
        "avg_batch": inferences / executions if executions > 0 else 0.0,
    }
