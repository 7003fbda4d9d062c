"""client.stats: window summaries from per-request records, and perf_analyzer's stability rule."""

from __future__ import annotations

import numpy as np
import pytest

from client.stats import Latency, Records, Window, is_stable, latency_summary, summarize


def window(throughput: float, latency: float, requests: int = 100) -> Window:
    lat = Latency(avg=latency, p50=latency, p90=latency, p95=latency, p99=latency, max=latency) if requests else None
    return Window(0, 1, requests, requests, throughput, lat, {})


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
    assert not is_stable([window(100, 10), window(100, 10), window(0, 0, 0)], 10.0)


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
    assert w.latency_us is not None
    assert w.latency_us.max == pytest.approx(20_000)  # from the scheduled time, not the send time
    assert w.errors == {"unavailable": 1}
    assert w.late_sends == 1
    assert w.server is None and w.power is None  # the engine adds those


def test_a_window_without_a_successful_request_has_no_latency() -> None:
    rec = Records()
    rec.add(0, 0, 10, "unavailable")
    w = summarize(rec, 0, 100, batch=1)
    assert w.requests == 0 and w.throughput == 0 and w.latency_us is None and w.errors == {"unavailable": 1}


def test_percentiles_interpolate_linearly_between_order_statistics() -> None:
    # Ten latencies (given in ns, out of order): 10, 20, ..., 90 µs and one 1000 µs outlier. The
    # linear method puts percentile p at position h = (n - 1) p / 100 of the sorted values and
    # interpolates: p50 at h = 4.5 lies between 50 and 60; p90 at h = 8.1 is 90 + 0.1 (1000 - 90).
    us = [70, 10, 1000, 40, 20, 90, 30, 60, 50, 80]
    s = latency_summary(np.array(us, dtype=np.int64) * 1000)
    assert s is not None
    assert (s.avg, s.p50, s.p90, s.p95, s.p99, s.max) == pytest.approx((145.0, 55.0, 181.0, 590.5, 918.1, 1000.0))
    # One latency: every percentile is that latency.
    one = latency_summary(np.array([2_500], dtype=np.int64))
    assert one == Latency(avg=2.5, p50=2.5, p90=2.5, p95=2.5, p99=2.5, max=2.5)
    assert latency_summary(np.array([], dtype=np.int64)) is None
