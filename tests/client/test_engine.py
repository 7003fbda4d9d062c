"""client.engine against the real tiny Triton: what each window and summary reports is what the
per-request records say (the engine's optional trace, which its statistics never read); windows are
contiguous; request-count windows close after N requests; the open loop keeps its own schedule (not the
server's pace), counts the sends that left a whole gap late, and caps the requests in flight."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable

import numpy as np
import pytest
from numpy.typing import NDArray

from client.engine import Distribution, LevelResult, LoadLevel, LoadRun, Measurement, send_times_ns
from client.inputs import InputData, build_payloads
from client.power import NoMeter, PowerSource
from client.protocol import Connection, Protocol
from client.stats import Records, Window
from tests.helpers.servers import Endpoints

MODEL = "mlp_fp32"


def measure(url: str, level: LoadLevel, measurement: Measurement, *, batch: int = 1,
            on_window: Callable[[int, Window], None] | None = None) -> tuple[LevelResult, Records]:
    """One level on a fresh connection; the result and every request's record."""

    async def go() -> tuple[LevelResult, Records]:
        async with await Connection.open(Protocol.GRPC, url) as conn:
            meta = await conn.model(MODEL)
            payloads = [await conn.prepare(MODEL, arrays) for arrays in build_payloads(meta, batch, InputData(), {})]
            run = LoadRun(conn, model=MODEL, payloads=payloads, batch=batch, meter=NoMeter("not measured here"),
                          measurement=measurement, on_window=on_window, keep_records=True)
            result = await run.run(level)
            assert run.records is not None
            return result, run.records

    return asyncio.run(go())


class Columns:
    """The records as arrays, with the questions the tests ask of them."""

    def __init__(self, records: Records) -> None:
        self.scheduled = np.asarray(records.scheduled, dtype=np.int64)
        self.sent = np.asarray(records.sent, dtype=np.int64)
        self.done = np.asarray(records.done, dtype=np.int64)
        self.ok = np.asarray([e is None for e in records.errors], dtype=bool)

    def completed(self, start_ns: int, end_ns: int) -> NDArray[np.bool_]:
        return (self.done >= start_ns) & (self.done < end_ns)

    def sent_in(self, start_ns: int, end_ns: int) -> NDArray[np.bool_]:
        return (self.sent >= start_ns) & (self.sent < end_ns)

    def late(self, rate: float) -> NDArray[np.bool_]:
        """Left at least one mean inter-arrival gap after the scheduled time."""
        return (self.sent - self.scheduled) >= 1e9 / rate

    def in_flight_peak(self) -> int:
        """The most requests ever between their send and their completion at the same time."""
        events = sorted([(int(t), 1) for t in self.sent] + [(int(t), -1) for t in self.done],
                        key=lambda e: (e[0], e[1]))  # a completion before a send at the same instant
        return int(np.max(np.cumsum([d for _, d in events])))


def schedule_gaps(cols: Columns) -> NDArray[np.int64]:
    """Gaps between consecutive scheduled send times, leaving out the tail that may be unrecorded."""
    gaps = np.diff(np.sort(cols.scheduled))
    assert len(gaps) > 10
    return gaps[:-3]


def test_closed_loop_windows_and_summary_count_exactly_the_records(endpoints: Endpoints) -> None:
    measurement = Measurement(measurement_ms=300, stability_percentage=0.001, max_trials=4, warmup_requests=5)
    result, records = measure(endpoints.grpc, LoadLevel(concurrency=3), measurement, batch=2)
    cols = Columns(records)
    assert len(result.windows) == 4 and not result.stable  # a rule nothing meets: every trial runs
    assert result.complete
    # Warm-up requests completed before the first window and are in no window.
    assert np.count_nonzero(cols.done < result.windows[0].start_ns) >= 5
    for earlier, later in zip(result.windows, result.windows[1:], strict=False):
        assert earlier.end_ns == later.start_ns  # contiguous: no request falls between two windows
    for w in result.windows:
        assert w.seconds >= 0.3
        inside = cols.completed(w.start_ns, w.end_ns)
        assert w.requests == np.count_nonzero(inside & cols.ok) > 0 and w.errors == {}
        assert w.inferences == 2 * w.requests and w.throughput == pytest.approx(w.inferences / w.seconds)
        assert w.latency_us is not None
        assert w.latency_us.max == pytest.approx(np.max(cols.done[inside] - cols.scheduled[inside]) / 1e3)
    # The summary is the last three windows merged: exactly what completed in their span.
    s, chosen = result.summary, result.windows[-3:]
    assert (s.start_ns, s.end_ns) == (chosen[0].start_ns, chosen[-1].end_ns)
    assert s.requests == np.count_nonzero(cols.completed(s.start_ns, s.end_ns) & cols.ok)
    assert s.requests == sum(w.requests for w in chosen)
    assert s.latency_us is not None
    inside = cols.completed(s.start_ns, s.end_ns) & cols.ok
    p99 = np.sort(cols.done[inside] - cols.scheduled[inside])[int(0.99 * (s.requests - 1) + 0.5)]
    assert s.latency_us.p99 == p99 / 1e3  # nearest rank over the pooled records
    assert s.inferences == 2 * s.requests and s.throughput == pytest.approx(s.inferences / s.seconds)
    # A closed loop never has more than `concurrency` requests out at once.
    assert cols.in_flight_peak() == 3
    assert result.power.source is PowerSource.NONE and result.power.reason == "not measured here"


def test_request_count_windows_close_after_n_requests(endpoints: Endpoints) -> None:
    concurrency = 2
    measurement = Measurement(request_count=40, stability_percentage=0.001, max_trials=3)  # 5 s windows otherwise
    result, records = measure(endpoints.grpc, LoadLevel(concurrency=concurrency), measurement)
    cols = Columns(records)
    assert len(result.windows) == 3
    for w in result.windows:
        inside = cols.completed(w.start_ns, w.end_ns)
        assert w.requests == np.count_nonzero(inside & cols.ok) >= 40
        # It closed in the loop steps right after its 40th completion (an event, not a poll nor the 5 s
        # measurement_ms), however slowly a loaded machine runs them: meanwhile each worker completes at most
        # the request it had in flight and the one it sent next, not a poll interval's worth.
        assert np.count_nonzero(inside) <= 40 + 2 * concurrency, np.count_nonzero(inside)


def test_open_loop_keeps_its_schedule_at_the_rate(endpoints: Endpoints) -> None:
    rate = 50.0
    measurement = Measurement(measurement_ms=600, stability_percentage=0.001, max_trials=3)
    result, records = measure(endpoints.grpc, LoadLevel(request_rate=rate), measurement)
    cols = Columns(records)
    s = result.summary
    assert s.errors == {} and s.requests == np.count_nonzero(cols.completed(s.start_ns, s.end_ns) & cols.ok)
    # As many completed in the span as were due in it, give or take the sends whose latency (counted from
    # the scheduled time, so a loaded machine's late sends included) moved them across its edges.
    assert s.latency_us is not None
    assert abs(s.requests - rate * s.seconds) <= rate * s.latency_us.max / 1e6 + 2, (s.requests, s.seconds)
    # Sends are scheduled every 1/rate s from the start, whatever the server's pace (the last few
    # may have been in flight when the level ended, and are not recorded).
    np.testing.assert_allclose(schedule_gaps(cols), 1e9 / rate, atol=2)
    for w in (*result.windows, s):
        inside = cols.completed(w.start_ns, w.end_ns)
        assert w.late_sends == np.count_nonzero(cols.sent_in(w.start_ns, w.end_ns) & cols.late(rate))
        assert w.dropped_sends == 0 and w.max_send_lag_us is not None
        assert w.latency_us is not None  # counted from the scheduled time, not the send time
        assert w.latency_us.max == pytest.approx(np.max(cols.done[inside] - cols.scheduled[inside]) / 1e3)


def test_poisson_arrivals_follow_the_seeded_exponential_gaps(endpoints: Endpoints) -> None:
    rate = 50.0
    measurement = Measurement(measurement_ms=500, stability_percentage=0.001, max_trials=2)
    _, records = measure(endpoints.grpc, LoadLevel(request_rate=rate, distribution=Distribution.POISSON),
                         measurement)
    gaps = schedule_gaps(Columns(records))
    level = LoadLevel(request_rate=rate, distribution=Distribution.POISSON)
    # A LoadRun without a seed draws from seed 0; the first gap comes before the first send.
    expected = np.diff(list(itertools.islice(send_times_ns(level, None), len(gaps) + 1)))
    np.testing.assert_allclose(gaps, expected, atol=2)
    assert 0.6 < gaps.mean() * rate / 1e9 < 1.4


def test_a_stalled_client_counts_its_overdue_sends_as_late_and_charges_the_wait(endpoints: Endpoints) -> None:
    rate, stall_s = 50.0, 0.3
    stall: list[int] = []

    def block_the_event_loop(index: int, window: Window) -> None:
        if index == 1:  # the callback runs on the engine's loop: nothing is sent while it sleeps
            stall.append(time.monotonic_ns())
            time.sleep(stall_s)
            stall.append(time.monotonic_ns())

    measurement = Measurement(measurement_ms=500, stability_percentage=0.001, max_trials=3)
    result, records = measure(endpoints.grpc, LoadLevel(request_rate=rate), measurement,
                              on_window=block_the_event_loop)
    cols = Columns(records)
    gap = 1e9 / rate
    overdue = (cols.scheduled >= stall[0]) & (cols.scheduled < stall[1] - gap)
    assert np.count_nonzero(overdue) >= 0.8 * rate * stall_s
    assert np.all(cols.sent[overdue] >= stall[1])  # they left only when the loop was free again
    assert np.all(cols.late(rate)[overdue])
    second = result.windows[1]
    sent = cols.sent_in(second.start_ns, second.end_ns)
    assert np.all(sent[overdue])  # they left in the window after the stall, and count there as late
    assert second.late_sends == np.count_nonzero(sent & cols.late(rate)) >= np.count_nonzero(overdue)
    assert second.max_send_lag_us is not None and second.max_send_lag_us >= (stall_s - 0.05) * 1e6
    # Latency counts from the scheduled time: the first overdue request waited out nearly the whole stall.
    assert result.summary.latency_us is not None and result.summary.latency_us.max >= (stall_s - 0.05) * 1e6
    assert result.summary.late_sends >= second.late_sends


def test_open_loop_caps_requests_in_flight_and_counts_the_dropped_sends(endpoints: Endpoints) -> None:
    # 2000 req/s against a 2-core server: far more than it answers, so the cap of 2 is reached at once.
    measurement = Measurement(measurement_ms=400, stability_percentage=0.001, max_trials=2)
    result, records = measure(endpoints.grpc, LoadLevel(request_rate=2000.0, max_inflight=2), measurement)
    cols = Columns(records)
    assert cols.in_flight_peak() <= 2
    s = result.summary
    assert s.dropped_sends > 0 and s.requests > 0
    # Every scheduled send in the windows was either sent or dropped: none vanished. The schedule is a slot
    # every 1/rate s; the slots between the span's first and last send that no send took were decided in
    # the span (in order, after the first), so each is among its dropped sends, however late they were decided.
    slots = np.round((np.sort(cols.scheduled[cols.sent_in(s.start_ns, s.end_ns)]) - cols.scheduled.min())
                     / (1e9 / 2000.0)).astype(np.int64)
    assert len(np.unique(slots)) == len(slots) > 1  # no slot sent twice
    missing = int(slots[-1] - slots[0] + 1) - len(slots)
    assert 0 < missing <= s.dropped_sends, (missing, s.dropped_sends)


def test_a_rate_beyond_what_the_loop_can_schedule_still_ends_each_window_on_time(endpoints: Endpoints) -> None:
    # Ten million sends a second: the schedule is always behind, so the open loop must still give the
    # event loop back (the sends it made run, the windows close); it reports the sends as late instead.
    result, records = measure(endpoints.grpc, LoadLevel(request_rate=1e7),
                              Measurement(measurement_ms=300, stability_percentage=100, max_trials=2))
    cols = Columns(records)
    assert len(result.windows) == 2 and all(w.seconds >= 0.29 for w in result.windows)  # timer: ±1 ms
    for w in result.windows:
        # It closed in the loop steps right after it was due, however late a loaded machine ran them: the
        # open loop made one send a step meanwhile, not the thousands of a loop that kept the CPU.
        due = w.start_ns + 300_000_000
        after_due = np.count_nonzero((cols.sent >= due) & (cols.sent < w.end_ns))
        assert after_due <= 20, after_due
    assert result.summary.requests > 0 and result.summary.late_sends > 0
    assert result.summary.latency_us is not None and len(records) > 0
