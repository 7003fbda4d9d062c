"""client.session: the library API. A config that validates itself, typed results, progress through a
callback, nothing printed, and a partial result when the server dies."""

from __future__ import annotations

import asyncio
import dataclasses
import http.server
import multiprocessing
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from client.engine import Abort, Distribution, LoadLevel, Measurement
from client.errors import PerfClientError
from client.inputs import InputData
from client.power import PowerSource
from client.protocol import Connection, Protocol
from client.session import WHOLE_RUN, ModelResult, RunAborted, SessionConfig, measure, run
from client.stats import Tally, Window
from client.workers import merge_tallies, shares
from tests.helpers.servers import Endpoints, PrivateServer, served
from tests.helpers.waiting import wait_until_async


def config(url: str, quick: Measurement, **changes: Any) -> SessionConfig:
    return SessionConfig(**{"models": ("mlp_fp32",), "url": url, "measurement": quick,
                            "power_source": PowerSource.NONE, **changes})


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: SessionConfig(models=(), url="h:1"), "-m []: expected one or more model names"),
        (lambda: SessionConfig(models=("m",), url="localhost"), "-u 'localhost': expected HOST:PORT"),
        (lambda: SessionConfig(models=("m",), url="https://localhost:8000", protocol="http"),
         "-u 'https://localhost:8000': expected HOST:PORT without a scheme (TLS: the --ssl-grpc-* or --ssl-https-*"),
        (lambda: SessionConfig(models=("m",), url="h:1", protocol="udp"),  # type: ignore[arg-type]
         "-i 'udp': expected one of grpc, http"),
        (lambda: SessionConfig(models=("m",), url="h:1", batch=0), "-b 0: expected a positive batch size"),
        (lambda: SessionConfig(models=("m",), url="h:1", levels=()), "expected at least one load level"),
        (lambda: SessionConfig(models=("m",), url="h:1", shapes={"ids": (0,)}), "--shape ids:0: expected NAME:D1"),
        (lambda: SessionConfig(models=("m",), url="h:1", power_source="wattmeter"),  # type: ignore[arg-type]
         "--power-source 'wattmeter': expected one of auto, nvml, triton, rapl, none"),
        (lambda: SessionConfig(models=("m",), url="h:1", metrics_url="h:8002"), "--metrics-url 'h:8002': expected"),
        (lambda: Measurement(max_trials=0), "--max-trials 0: expected an integer >= 1"),
        (lambda: Measurement(measurement_ms=0), "--measurement-interval 0: expected an integer >= 1"),
        (lambda: Measurement(warmup_requests=-1), "--warmup -1: expected an integer >= 0"),
        (lambda: Measurement(stability_percentage=0), "--stability-percentage 0: expected 0 < P <= 100"),
        (lambda: LoadLevel(concurrency=0), "--concurrency 0: expected a positive integer"),
        (lambda: LoadLevel(request_rate=-5.0), "--request-rate -5.0: expected a positive rate"),
        (lambda: LoadLevel(request_rate=5.0, distribution="bursty"),  # type: ignore[arg-type]
         "--distribution 'bursty': expected one of"),
        (lambda: LoadLevel(), "exactly one of --concurrency and --request-rate"),
    ],
)
def test_invalid_configs_cannot_be_made_and_name_the_flag(make: Any, message: str) -> None:
    with pytest.raises(PerfClientError) as caught:
        make()
    assert message in str(caught.value)


def test_defaults_and_plain_strings() -> None:
    c = SessionConfig(models=["m"], url="gpu-7.lan:9001", protocol="http", power_source="none")  # type: ignore[arg-type]
    assert c.models == ("m",) and c.protocol is Protocol.HTTP and c.power_source is PowerSource.NONE
    assert c.metrics_endpoint == "http://gpu-7.lan:8002/metrics"
    assert c.levels == (LoadLevel(concurrency=1),) and c.input_data == InputData() and c.batch == 1
    assert dataclasses.replace(c, metrics_url="http://m:1/x").metrics_endpoint == "http://m:1/x"
    assert LoadLevel(request_rate=2, distribution="poisson").distribution is Distribution.POISSON  # type: ignore[arg-type]
    with pytest.raises(PerfClientError, match="--max-trials 0"):
        dataclasses.replace(c, measurement=dataclasses.replace(c.measurement, max_trials=0))


@pytest.mark.parametrize("protocol", list(Protocol))
def test_typed_results_and_progress_without_printing(
    protocol: Protocol, endpoints: Endpoints, quick: Measurement, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: list[tuple[str, LoadLevel, int, Window]] = []
    levels = (LoadLevel(concurrency=1), LoadLevel(concurrency=3))
    rows = run(config(endpoints.url(protocol), quick, protocol=protocol, levels=levels,
                      models=("mlp_fp32", "mlp_int8")), lambda *args: seen.append(args))
    assert [(r.model, r.result.level) for r in rows] == [(m, lv) for m in ("mlp_fp32", "mlp_int8") for lv in levels]
    for row in rows:
        r = row.result
        assert r.complete and 1 <= len(r.windows) <= quick.max_trials
        assert r.stable or len(r.windows) == quick.max_trials  # a level stops early only when stable
        assert r.summary.throughput > 0 and r.summary.errors == {} and r.summary.latency_us is not None
        assert r.summary.latency_us.p50 <= r.summary.latency_us.p99
        assert r.server.requests is not None and r.server.requests > 0
        assert r.server.avg_batch is not None and r.server.avg_batch >= 1
        assert r.power.source is PowerSource.NONE and r.power.energy_j is None and r.power.reason
        assert all(w.server is not None and w.power is not None for w in r.windows)
    # One callback per window, numbered from 1 within each (model, level), in order.
    for row in rows:
        indices = [i for m, lv, i, _ in seen if m == row.model and lv == row.result.level]
        assert indices == list(range(1, len(row.result.windows) + 1))
    assert capsys.readouterr() == ("", "")


def test_request_count_windows_and_server_side_counts(endpoints: Endpoints, quick: Measurement) -> None:
    url = endpoints.url(Protocol.HTTP)

    async def server_successes() -> int:
        async with await Connection.open(Protocol.HTTP, url) as conn:
            stats = await conn.statistics("mlp_fp16")
        assert stats is not None
        return stats.success_count

    before = asyncio.run(server_successes())
    measurement = Measurement(request_count=30, max_trials=3, warmup_requests=0)
    (row,) = run(config(url, measurement, protocol=Protocol.HTTP, models=("mlp_fp16",),
                        levels=(LoadLevel(concurrency=2),)))
    after = asyncio.run(server_successes())
    assert all(w.requests >= 30 for w in row.result.windows)
    # The server saw every request the client completed, plus the probe and the ones in flight
    # when the level ended (at most the concurrency).
    assert sum(w.requests for w in row.result.windows) <= after - before
    assert row.result.server.requests is not None and row.result.server.requests >= 1


def test_open_loop_holds_the_rate_and_reports_a_client_stall_as_late_sends(endpoints: Endpoints) -> None:
    rate, stall_s = 80.0, 0.3

    def stall_after_the_first_window(model: str, level: LoadLevel, index: int, window: Window) -> None:
        if index == 1:  # progress runs on the session's event loop: no request leaves while it sleeps
            time.sleep(stall_s)

    measurement = Measurement(measurement_ms=1500, max_trials=3, stability_percentage=60)
    (row,) = run(config(endpoints.grpc, measurement, models=("mlp_fp16",),
                        levels=(LoadLevel(request_rate=rate),)),
                 stall_after_the_first_window)
    summary, after_stall = row.result.summary, row.result.windows[1]
    # The open loop catches up after the stall: the rate holds over the level, give or take the sends whose
    # latency (from the scheduled time: the stall's and a loaded machine's late sends included) moved them
    # across the summary's edges.
    assert summary.errors == {} and summary.latency_us is not None
    due = rate * summary.seconds
    assert abs(summary.requests - due) <= rate * summary.latency_us.max / 1e6 + 2, (summary.requests, due)
    # Every send scheduled during the stall left late, and its latency counts from its scheduled time.
    assert after_stall.late_sends >= 0.8 * rate * stall_s
    assert after_stall.latency_us is not None and after_stall.latency_us.max >= (stall_s - 0.05) * 1e6
    assert after_stall.late_sends <= summary.late_sends <= summary.requests


def test_the_server_dying_mid_run_gives_the_windows_measured_so_far(private_server: PrivateServer,
                                                                     quick: Measurement) -> None:
    def stop_after_three(model: str, level: LoadLevel, index: int, window: Window) -> None:
        if index == 3:
            private_server.stop()

    measurement = dataclasses.replace(quick, stability_percentage=0.001, max_trials=40)
    with pytest.raises(RunAborted) as caught:
        run(config(private_server.endpoints.grpc, measurement, levels=(LoadLevel(concurrency=2),)), stop_after_three)
    assert "the server stopped answering during concurrency 2" in str(caught.value)
    (row,) = caught.value.partial
    assert isinstance(row, ModelResult) and row.model == "mlp_fp32"
    r = row.result
    assert not r.complete and not r.stable and not r.failed and "stopped answering" in (r.stop_reason or "")
    # The windows measured before the server went: each with successes and no sign of its end; the
    # summary over the last three of them, with real figures.
    assert 3 <= len(r.windows) < 40
    assert all(w.requests > 0 and not {"unavailable", "unknown_model"} & w.errors.keys() for w in r.windows)
    assert r.summary.throughput > 0 and r.summary.latency_us is not None and r.summary.latency_us.p50 > 0
    assert r.summary.requests == sum(w.requests for w in r.windows[-3:])
    assert r.server.requests is not None and r.server.requests > 0  # counters read at those windows' ends


def test_an_abort_keeps_the_completed_windows_and_drops_the_open_one(endpoints: Endpoints,
                                                                      quick: Measurement) -> None:
    measurement = dataclasses.replace(quick, stability_percentage=0.001, max_trials=40)

    async def go() -> list[ModelResult]:
        abort = Abort()

        def abort_in_window_three(model: str, level: LoadLevel, index: int, window: Window) -> None:
            # Window 3 opened as window 2 closed (window.end_ns): abort it 0.1 s in, well before its 0.4 s
            # end, or now if this callback itself came later than that (the readings at window 2's end
            # are awaited first, which a loaded machine slows). Timed from the window, not from this call.
            if index == 2:
                at = window.end_ns / 1e9 + 0.1  # time.monotonic(), the clock of the loop's timers
                if time.monotonic() >= at:
                    abort.set("interrupted (test)")
                else:
                    asyncio.get_running_loop().call_at(at, abort.set, "interrupted (test)")

        return await measure(config(endpoints.grpc, measurement, levels=(LoadLevel(concurrency=2),)),
                             abort_in_window_three, abort)

    with pytest.raises(RunAborted, match="interrupted \\(test\\)") as caught:
        asyncio.run(go())
    (row,) = caught.value.partial
    r = row.result
    assert not r.complete and not r.stable and r.stop_reason == "interrupted (test)"
    assert len(r.windows) == 2 and all(w.seconds >= 0.4 for w in r.windows)  # the cut third is left out
    assert r.summary.throughput > 0 and r.summary.latency_us is not None


def test_the_time_limit_ends_the_run_with_what_was_measured(endpoints: Endpoints, quick: Measurement) -> None:
    measurement = dataclasses.replace(quick, stability_percentage=0.001, max_trials=40)
    started = time.monotonic()
    with pytest.raises(RunAborted, match=r"--time-limit 1\.5 s reached") as caught:
        run(config(endpoints.grpc, measurement, levels=(LoadLevel(concurrency=1), LoadLevel(concurrency=2)),
                   time_limit_s=1.5))
    assert time.monotonic() - started < 10
    (row,) = caught.value.partial
    assert row.result.level.concurrency == 1 and not row.result.complete and 1 <= len(row.result.windows) <= 3


class GatedMetrics(http.server.BaseHTTPRequestHandler):
    """Triton-like metrics with a GPU energy counter. Its first read (the meter's open, before any load) is
    answered at once; every later one only once the server has answered AHEAD more requests since it arrived,
    or, failing that, after LIMIT_S (recorded in `held`): a read made on the run's event loop would stop the
    requests it waits for, and hit the limit."""

    AHEAD, LIMIT_S = 10, 1.5  # the meter's own HTTP timeout is 2 s
    triton_http = ""
    reads = 0
    held: ClassVar[list[int]] = []

    def do_GET(self) -> None:
        cls = GatedMetrics
        cls.reads += 1
        if cls.reads > 1:
            start, deadline = served(cls.triton_http, "mlp_fp32"), time.monotonic() + cls.LIMIT_S
            while (done := served(cls.triton_http, "mlp_fp32") - start) < cls.AHEAD:
                if time.monotonic() >= deadline:
                    cls.held.append(done)
                    break
                time.sleep(0.005)
        body = f'nv_energy_consumption{{gpu_uuid="GPU-test"}} {10.0 * cls.reads}\n'.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_a_slow_metrics_endpoint_does_not_delay_requests(endpoints: Endpoints) -> None:
    # Each meter read at a window boundary is answered only once the run has had ten more requests answered
    # meanwhile: true of a read off the event loop, however slow the machine; a read on the loop would let
    # at most the two in flight finish, and wait out the limit.
    GatedMetrics.triton_http, GatedMetrics.reads, GatedMetrics.held = endpoints.http, 0, []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), GatedMetrics)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    measurement = Measurement(measurement_ms=400, stability_percentage=0.001, max_trials=3, warmup_requests=5)
    try:
        (row,) = run(config(endpoints.grpc, measurement, levels=(LoadLevel(concurrency=2),),
                            power_source=PowerSource.TRITON,
                            metrics_url=f"http://127.0.0.1:{server.server_address[1]}/metrics"))
    finally:
        server.shutdown()
    # The meter was read (energy per window) while requests kept going.
    assert row.result.power.source is PowerSource.TRITON and row.result.power.energy_j is not None
    assert all(w.power is not None and w.power.energy_j is not None for w in row.result.windows)
    assert GatedMetrics.reads >= 1 + len(row.result.windows) + 1  # the open, then one read per boundary
    assert GatedMetrics.held == []


def test_opening_the_meter_leaves_the_event_loop_serving(endpoints: Endpoints, quick: Measurement) -> None:
    """The Triton meter's first read (a blocking HTTP GET) is answered only once another coroutine of the run's
    event loop releases it: only a read off the loop gets its answer before its own 2 s timeout."""
    asked, released = threading.Event(), threading.Event()

    class HeldMetrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            asked.set()
            released.wait(10)
            body = b'nv_energy_consumption{gpu_uuid="GPU-test"} 1.0\n'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), HeldMetrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/metrics"

    async def go() -> list[ModelResult]:
        async def release_once_asked() -> None:
            await wait_until_async(asked.is_set, what="the meter's first read", timeout_s=60)
            released.set()

        rows, _ = await asyncio.gather(
            measure(config(endpoints.grpc, quick, levels=(LoadLevel(concurrency=1),),
                           power_source=PowerSource.TRITON, metrics_url=url)),
            release_once_asked())
        return rows

    try:
        (row,) = asyncio.run(go())
    finally:
        released.set()
        server.shutdown()
    assert row.result.power.source is PowerSource.TRITON, row.result.power.reason


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"models": ("resnet_nope",)}, "-m resnet_nope: model is not served"),
        ({"models": ("seq_fp32",)}, "has dynamic dims [-1]; expected --shape ids:DIMS"),
        ({"shapes": {"pixels": (3,)}}, "--shape pixels: not an input of mlp_fp32"),
        ({"batch": 64}, "-b 64: model mlp_fp32 accepts at most 8"),
    ],
)
def test_bad_requests_fail_before_any_load(changes: dict[str, Any], message: str, endpoints: Endpoints,
                                           quick: Measurement) -> None:
    with pytest.raises(PerfClientError) as caught:
        run(config(endpoints.grpc, quick, **changes))
    assert message in str(caught.value) and not isinstance(caught.value, RunAborted)


@pytest.mark.parametrize("protocol", list(Protocol))
def test_a_request_the_server_rejects_is_reported_with_its_reason(
    protocol: Protocol, endpoints: Endpoints, quick: Measurement, tmp_path: Path
) -> None:
    np.savez(tmp_path / "ids.npz", ids=np.full((4, 12), 999, dtype=np.int64))  # beyond the 50-token table
    with pytest.raises(PerfClientError, match="-m seq_fp32: the server rejected the request: "):
        run(config(endpoints.url(protocol), quick, protocol=protocol, models=("seq_fp32",),
                   input_data=InputData.parse(str(tmp_path / "ids.npz"))))


def test_unreachable_server(dead_url: str, quick: Measurement) -> None:
    with pytest.raises(PerfClientError, match=f"-u {dead_url}: cannot reach Triton over grpc"):
        asyncio.run(measure(config(dead_url, quick)))


def test_simultaneous_models_share_the_time_and_the_whole_run_has_the_energy(endpoints: Endpoints) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FastMetrics)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    measurement = Measurement(measurement_ms=400, stability_percentage=60, max_trials=4, warmup_requests=5)
    try:
        rows = run(SessionConfig(
            models=("mlp_fp32", "mlp_int8"), url=endpoints.grpc, measurement=measurement,
            levels=(LoadLevel(concurrency=2),), model_levels={"mlp_int8": (LoadLevel(concurrency=1),)},
            simultaneous=True, power_source=PowerSource.TRITON,
            metrics_url=f"http://127.0.0.1:{server.server_address[1]}/metrics"))
    finally:
        server.shutdown()
    assert [r.model for r in rows] == ["mlp_fp32", "mlp_int8", WHOLE_RUN]
    fp32, int8, whole = (r.result for r in rows)
    assert (fp32.level.concurrency, int8.level.concurrency) == (2, 1)
    for r in (fp32, int8):
        assert r.complete and r.summary.requests > 0 and r.server.requests is not None and r.server.requests > 0
        assert r.power.energy_j is None and r.power.reason and "whole run" in r.power.reason
    # Under load together: each model's measured windows lie inside the span where both were loaded.
    assert max(fp32.windows[0].start_ns, int8.windows[0].start_ns) < min(fp32.windows[-1].end_ns,
                                                                        int8.windows[-1].end_ns)
    # The whole run spans from the moment both were measuring to the moment both were done, and counts
    # every inference completed in it: at the sum of the two models' rates.
    assert whole.summary.start_ns >= max(fp32.windows[0].start_ns, int8.windows[0].start_ns)
    assert whole.summary.end_ns >= max(fp32.windows[-1].end_ns, int8.windows[-1].end_ns)
    assert whole.summary.throughput == pytest.approx(fp32.summary.throughput + int8.summary.throughput, rel=0.5)
    assert whole.summary.requests == fp32.summary.requests + int8.summary.requests  # pooled latencies
    assert whole.power.source is PowerSource.TRITON and whole.power.energy_j is not None
    assert whole.power.energy_j > 0 and whole.power.j_per_infer is not None


def test_simultaneous_needs_two_models_and_equal_sweeps() -> None:
    with pytest.raises(PerfClientError, match="--simultaneous: expected two or more -m models"):
        SessionConfig(models=("a",), url="h:1", simultaneous=True)
    with pytest.raises(PerfClientError, match="the same number of load levels"):
        SessionConfig(models=("a", "b"), url="h:1", simultaneous=True,
                      levels=(LoadLevel(concurrency=1), LoadLevel(concurrency=2)),
                      model_levels={"b": (LoadLevel(concurrency=4),)})
    with pytest.raises(PerfClientError, match="--model-concurrency/--model-request-rate c: not among -m a, b"):
        SessionConfig(models=("a", "b"), url="h:1", model_levels={"c": (LoadLevel(concurrency=4),)})


class FastMetrics(http.server.BaseHTTPRequestHandler):
    """Triton-like metrics with a GPU energy counter, answered at once."""

    joules = 0.0

    def do_GET(self) -> None:
        FastMetrics.joules += 10.0
        body = f'nv_energy_consumption{{gpu_uuid="GPU-test"}} {FastMetrics.joules}\n'.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_worker_processes_drive_the_load_and_their_counts_add_up(endpoints: Endpoints) -> None:
    measurement = Measurement(measurement_ms=500, stability_percentage=60, max_trials=3, warmup_requests=10)
    (row,) = run(config(endpoints.grpc, measurement, levels=(LoadLevel(concurrency=4),), processes=2))
    r = row.result
    assert r.complete and r.summary.errors == {} and r.summary.requests > 0 and r.summary.latency_us is not None
    # The server counted what the two processes' merged tallies say, up to the requests in flight at
    # the two boundaries and those completed while its counters were being read (1 %).
    assert r.server.requests is not None
    assert abs(r.server.requests - r.summary.requests) <= max(2 * 4, 0.01 * r.summary.requests)
    assert multiprocessing.active_children() == []  # the workers are gone


def test_merged_tallies_keep_every_record() -> None:
    a, b = Tally(), Tally()
    for value in (5, 1, 9):
        a.ok(value)
    b.ok(3)
    a.failed("timeout")
    b.failed("timeout")
    b.failed("unavailable")
    b.lag(7, late=True)
    merged = merge_tallies([a, b])
    assert sorted(merged.latencies) == [1, 3, 5, 9] and merged.errors == {"timeout": 2, "unavailable": 1}
    assert (merged.late, merged.max_lag_ns, merged.completed) == (1, 7, 7)
    assert [level.concurrency for level, _ in shares(LoadLevel(concurrency=5), 2)] == [3, 2]
    halves = shares(LoadLevel(request_rate=100.0), 2)
    assert [(level.request_rate, offset) for level, offset in halves] == [(50.0, 0.0), (50.0, 1e7)]
    with pytest.raises(PerfClientError, match=r"^--processes 3: not with --concurrency 2 \(expected at least one"):
        SessionConfig(models=("m",), url="h:1", levels=(LoadLevel(concurrency=2),), processes=3)
