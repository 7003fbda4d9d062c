"""client.server_stats: Triton's counters from either protocol, and the per-request breakdown."""

from __future__ import annotations

import pytest

from client.server_stats import ServerBreakdown, ServerStats, parse_statistics, server_breakdown


def test_server_breakdown_is_per_request_and_average_batch() -> None:
    before = ServerStats(10, 1_000_000, 0, 5_000_000, 0, 40, 10)
    after = ServerStats(20, 3_000_000, 100_000, 15_000_000, 200_000, 80, 15)
    b = server_breakdown(before, after)
    assert b.requests == 10
    assert b.queue_us == pytest.approx(200.0)
    assert b.compute_infer_us == pytest.approx(1000.0)
    assert b.avg_batch == pytest.approx(8.0)
    assert b.total_us == pytest.approx(200.0 + 10.0 + 1000.0 + 20.0)


def test_an_execution_counted_before_its_inferences_reads_no_batch_below_one() -> None:
    """Two snapshots around a batch in flight: its execution is counted and its inference not yet."""
    before = ServerStats(100, 0, 0, 0, 0, 100, 100)
    after = ServerStats(2339, 0, 0, 1, 0, 2339, 2340)
    assert server_breakdown(before, after).avg_batch == 1.0


def test_what_was_not_measured_is_none_not_zero() -> None:
    idle = ServerStats(10, 5, 5, 5, 5, 40, 10)
    b = server_breakdown(idle, idle)
    assert b.requests == 0 and b.queue_us is None and b.avg_batch is None and b.total_us is None
    assert server_breakdown(None, idle) == ServerBreakdown()  # a snapshot failed: nothing is known
    assert ServerBreakdown().requests is None


def test_statistics_payloads_from_both_protocols_parse_alike() -> None:
    grpc_json = {"model_stats": [{"name": "m", "inference_count": "12", "execution_count": "3",
                                  "inference_stats": {"success": {"count": "6", "ns": "9"},
                                                      "queue": {"count": "6", "ns": "600"}}}]}
    http_json = {"model_stats": [{"name": "m", "inference_count": 12, "execution_count": 3,
                                  "inference_stats": {"success": {"count": 6, "ns": 9},
                                                      "queue": {"count": 6, "ns": 600}}}]}
    parsed = parse_statistics(grpc_json, "m")
    assert parsed == parse_statistics(http_json, "m")
    assert parsed is not None and parsed.queue_ns == 600 and parsed.success_count == 6
    assert parse_statistics(grpc_json, "other") is None
