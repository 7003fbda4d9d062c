"""Triton's cumulative statistics counters, and the per-request server breakdown over an interval."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ServerStats:
    """Cumulative counters from Triton's statistics API (nanoseconds and counts)."""

    success_count: int = 0
    queue_ns: int = 0
    compute_input_ns: int = 0
    compute_infer_ns: int = 0
    compute_output_ns: int = 0
    inference_count: int = 0
    execution_count: int = 0


@dataclass(frozen=True)
class ServerBreakdown:
    """Average server-side times per successful request (µs) and the achieved batch.

    `requests` is None when the counters could not be read at both ends; a time is None when no
    request succeeded in between, `avg_batch` when the model executed nothing.
    """

    requests: int | None = None
    queue_us: float | None = None
    compute_input_us: float | None = None
    compute_infer_us: float | None = None
    compute_output_us: float | None = None
    avg_batch: float | None = None

    @property
    def total_us(self) -> float | None:
        """Queue plus compute time per request, None when any part is missing."""
        parts = (self.queue_us, self.compute_input_us, self.compute_infer_us, self.compute_output_us)
        return None if any(p is None for p in parts) else sum(p for p in parts if p is not None)


def _int(value: Any) -> int:
    # gRPC's JSON form gives 64-bit counters as strings, HTTP's as numbers; absent means never counted.
    return int(value) if value not in (None, "") else 0


def _part(stats: dict[str, Any], key: str) -> dict[str, Any]:
    value = stats.get(key, {})
    return value if isinstance(value, dict) else {}


def parse_statistics(payload: dict[str, Any], model: str) -> ServerStats | None:
    """The model's counters from a statistics response (either protocol's JSON), None if it is absent."""
    for entry in payload.get("model_stats", []):
        if entry.get("name") != model:
            continue
        stats = entry.get("inference_stats", {})
        return ServerStats(
            success_count=_int(_part(stats, "success").get("count")),
            queue_ns=_int(_part(stats, "queue").get("ns")),
            compute_input_ns=_int(_part(stats, "compute_input").get("ns")),
            compute_infer_ns=_int(_part(stats, "compute_infer").get("ns")),
            compute_output_ns=_int(_part(stats, "compute_output").get("ns")),
            inference_count=_int(entry.get("inference_count")),
            execution_count=_int(entry.get("execution_count")),
        )
    return None


def server_breakdown(before: ServerStats | None, after: ServerStats | None) -> ServerBreakdown:
    """Per-request averages between two snapshots; every figure None when a snapshot is missing."""
    if before is None or after is None:
        return ServerBreakdown()
    requests = after.success_count - before.success_count
    executions = after.execution_count - before.execution_count
    inferences = after.inference_count - before.inference_count

    def per_request(a: int, b: int) -> float | None:
        return (b - a) / requests / 1e3 if requests > 0 else None

    return ServerBreakdown(
        requests=requests,
        queue_us=per_request(before.queue_ns, after.queue_ns),
        compute_input_us=per_request(before.compute_input_ns, after.compute_input_ns),
        compute_infer_us=per_request(before.compute_infer_ns, after.compute_infer_ns),
        compute_output_us=per_request(before.compute_output_ns, after.compute_output_ns),
        # A batch holds one inference at least; a snapshot taken while a batch runs can count its execution before
        # its inferences (2239 inferences over 2240 executions at concurrency 1 in a CI run), so no less than 1.
        avg_batch=max(1.0, inferences / executions) if executions > 0 else None,
    )
