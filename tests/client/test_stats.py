"""client.stats: windows from per-window tallies, perf_analyzer's nearest-rank percentiles, exact merges
and its stability rule."""

from __future__ import annotations

import numpy as np
import pytest

from client.stats import Latency, Tally, Window, close, is_stable, latency_summary, merge, nearest_rank


def window(throughput: float, latency: float, requests: int = 100) -> Window:
    lat = Latency(avg=latency, p50=latency, p90=latency, p95=latency, p99=latency, max=latency) if requests else None
    return Window(0, 1, requests, requests, throughput, lat, {})


@pytest.mark.parametrize(
    ("series", "stable"),
    [
        ([(100, 10), (104, 10.5), (97, 9.8)], True),  # max/min 1.072 and 1.071
        ([(100, 10), (111, 10), (101, 10)], False),  # throughput max/min 1.11 > 1.10
        ([(100, 10), (101, 11.2), (99, 10)], False),  # latency max/min 1.12
        ([(100, 10), (109.9, 10), (105, 10.99)], True),  # each just inside: max/min, not distance from the mean
        ([(50, 30), (100, 10), (101, 10), (99, 10.2)], True),  # only the last three count
        ([(100, 10), (100, 10)], False),  # fewer than three windows
    ],
)
def test_stability_is_perf_analyzers_max_over_min_rule(series: list[tuple[float, float]], stable: bool) -> None:
    assert is_stable([window(t, lat) for t, lat in series], 10.0) is stable


def test_empty_windows_are_never_stable() -> None:
    assert not is_stable([window(0, 0, 0)] * 3, 10.0)
    assert not is_stable([window(100, 10), window(100, 10), window(0, 0, 0)], 10.0)


def test_nearest_rank_is_perf_analyzers_index_on_fixed_data() -> None:
    # perf_analyzer (inference_profiler.cc, SummarizeLatency) sorts the latencies and takes
    # latencies[size_t((p / 100.0) * (n - 1) + 0.5)]. Ten values 10..100 µs: p50 -> index int(5.0) = 5
    # (60 µs); p90 -> int(8.6) = 8 (90 µs); p95 -> int(9.05) = 9 (100 µs); p99 -> int(9.41) = 9.
    us = [70, 10, 100, 40, 20, 90, 30, 60, 50, 80]
    s = latency_summary(np.sort(np.array(us, dtype=np.int64) * 1000))
    assert s == Latency(avg=55.0, p50=60.0, p90=90.0, p95=100.0, p99=100.0, max=100.0)
    # Not the interpolated figure numpy's default gives (55 µs for p50, 91 for p90).
    assert float(np.percentile(us, 50)) == 55.0 and s.p50 != 55.0
    # 101 values 0..100 ns: index (p/100)·100 + 0.5 truncated is p itself.
    values = np.arange(101, dtype=np.int64)
    assert [nearest_rank(values, p) for p in (50, 90, 95, 99)] == [50, 90, 95, 99]
    # Two values: p50 -> int(0.5 + 0.5) = 1, the larger one (perf_analyzer rounds half up).
    assert nearest_rank(np.array([1000, 3000], dtype=np.int64), 50) == 3000
    one = latency_summary(np.array([2_500], dtype=np.int64))
    assert one == Latency(avg=2.5, p50=2.5, p90=2.5, p95=2.5, p99=2.5, max=2.5)


def test_a_window_counts_its_tally() -> None:
    ms = 1_000_000
    tally = Tally()
    for latency in (30 * ms, 10 * ms, 20 * ms):
        tally.ok(latency)
    tally.failed("unavailable")
    tally.lag(4 * ms, late=False)
    tally.lag(25 * ms, late=True)
    assert tally.completed == 4
    w = close(tally, 10 * ms, 100 * ms, batch=4)
    assert w.requests == 3 and w.inferences == 12
    assert w.throughput == pytest.approx(12 / 0.09)
    assert w.latency_us is not None and (w.latency_us.p50, w.latency_us.max) == (20_000.0, 30_000.0)
    assert w.errors == {"unavailable": 1} and w.late_sends == 1 and w.max_send_lag_us == 25_000.0
    assert w.server is None and w.power is None  # the engine adds those
    assert list(w.latencies_ns) == [10 * ms, 20 * ms, 30 * ms]


def test_an_empty_window_has_null_latencies_not_zero() -> None:
    w = close(Tally(), 0, 10**9, batch=1)
    assert w.requests == 0 and w.throughput == 0 and w.latency_us is None and w.errors == {}
    assert w.max_send_lag_us is None  # closed loop: nothing scheduled, nothing measured
    failed = Tally()
    failed.failed("timeout")
    w = close(failed, 0, 10**9, batch=1)
    assert w.latency_us is None and w.errors == {"timeout": 1}


def test_a_merge_pools_the_latencies_exactly() -> None:
    rng = np.random.default_rng(3)
    parts = [rng.integers(1_000, 90_000, size=n) for n in (40, 1, 77)]
    windows = []
    for i, part in enumerate(parts):
        tally = Tally()
        for value in part:
            tally.ok(int(value))
        tally.failed("timeout")
        windows.append(close(tally, i * 10**9, (i + 1) * 10**9, batch=2))
    merged = merge(windows, batch=2)
    pooled = np.sort(np.concatenate(parts))
    assert merged.latency_us == latency_summary(pooled)  # not an average of the windows' percentiles
    assert merged.requests == 118 and merged.inferences == 236
    assert merged.throughput == pytest.approx(236 / 3.0)
    assert merged.errors == {"timeout": 3} and (merged.start_ns, merged.end_ns) == (0, 3 * 10**9)
    assert merge([close(Tally(), 0, 10**9, 1)], batch=1).latency_us is None
