import numpy as np
import pytest

from client.protocol import ServerStats, parse_statistics
from client.stats import Records, Window, is_stable, latency_summary, server_breakdown, summarize


def window(throughput: float, latency: float, requests: int = 100) -> Window:
    return Window(0, 1, requests, requests, throughput, {"avg": latency}, {})


@pytest.mark.parametrize(
    ("series", "stable"),
    [
        ([(100, 10), (104, 10.5), (97, 9.8)], True),
        ([(100, 10), (125, 10), (98, 10)], False),  # throughput outside ±10 %
        ([(100, 10), (101, 13), (99, 10)], False),  # latency outside ±10 %
        ([(50, 30), (100, 10), (101, 10), (99, 10.2)], True),  # only the last three count
        ([(100, 10), (100, 10)], False),  # fewer than three windows
    ],
)
def test_stability_rule_on_recorded_series(series: list[tuple[float, float]], stable: bool) -> None:
    assert is_stable([window(t, lat) for t, lat in series], 10.0) is stable


def test_empty_windows_are_never_stable() -> None:
    assert not is_stable([window(0, 0, 0)] * 3, 10.0)


def test_summary_counts_only_requests_completed_in_the_window() -> None:
    rec = Records()
    ms = 1_000_000
    rec.add(0, 0, 5 * ms, None)           # before the window
    rec.add(10 * ms, 10 * ms, 20 * ms, None)
    rec.add(10 * ms, 14 * ms, 30 * ms, None)  # sent 4 ms late (open loop)
    rec.add(40 * ms, 40 * ms, 50 * ms, "unavailable")
    rec.add(90 * ms, 90 * ms, 150 * ms, None)  # after the window
    w = summarize(rec, 10 * ms, 100 * ms, batch=4)
    assert w.requests == 2 and w.inferences == 8
    assert w.throughput == pytest.approx(8 / 0.09)
    assert w.latency_us["max"] == pytest.approx(20_000)  # from the scheduled time, not the send time
    assert w.errors == {"unavailable": 1}
    assert w.late_sends == 1


def test_percentiles_match_numpy() -> None:
    lat = np.arange(1, 1001, dtype=np.int64) * 1000
    s = latency_summary(lat)
    assert s["p50"] == pytest.approx(np.percentile(lat / 1e3, 50))
    assert s["p99"] == pytest.approx(np.percentile(lat / 1e3, 99))
    assert s["max"] == 1000.0 and s["avg"] == pytest.approx(500.5)


def test_server_breakdown_is_per_request_and_average_batch() -> None:
    before = ServerStats(10, 1_000_000, 0, 5_000_000, 0, 40, 10)
    after = ServerStats(20, 3_000_000, 100_000, 15_000_000, 200_000, 80, 15)
    b = server_breakdown(before, after)
    assert b["queue_us"] == pytest.approx(200.0)
    assert b["compute_infer_us"] == pytest.approx(1000.0)
    assert b["avg_batch"] == pytest.approx(8.0)


def test_statistics_payloads_from_both_protocols_parse_alike() -> None:
    grpc_json = {"model_stats": [{"name": "m", "inference_count": "12", "execution_count": "3",
                                  "inference_stats": {"success": {"count": "6", "ns": "9"},
                                                      "queue": {"count": "6", "ns": "600"}}}]}
    http_json = {"model_stats": [{"name": "m", "inference_count": 12, "execution_count": 3,
                                  "inference_stats": {"success": {"count": 6, "ns": 9},
                                                      "queue": {"count": 6, "ns": 600}}}]}
    assert parse_statistics(grpc_json, "m") == parse_statistics(http_json, "m")
    assert parse_statistics(grpc_json, "m").queue_ns == 600
    assert parse_statistics(grpc_json, "other") == ServerStats()
