"""client.session: the library API. A config that validates itself, typed results, progress through a
callback, nothing printed, and a partial result when the server dies."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from client.engine import Distribution, LoadLevel, Measurement
from client.errors import PerfClientError, RunAborted
from client.inputs import InputData
from client.power import PowerSource
from client.protocol import Connection, Protocol
from client.session import ModelResult, SessionConfig, measure, run
from client.stats import Window
from tests.helpers.servers import Endpoints, PrivateServer


def config(url: str, quick: Measurement, **changes: Any) -> SessionConfig:
    return SessionConfig(**{"models": ("mlp_fp32",), "url": url, "measurement": quick,
                            "power_source": PowerSource.NONE, **changes})


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: SessionConfig(models=(), url="h:1"), "-m []: expected one or more model names"),
        (lambda: SessionConfig(models=("m",), url="localhost"), "-u 'localhost': expected HOST:PORT"),
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
    # The open loop catches up after the stall: the rate holds over the level.
    assert summary.throughput == pytest.approx(rate, rel=0.35) and summary.errors == {}
    # Every send scheduled during the stall left late, and its latency counts from its scheduled time.
    assert after_stall.late_sends >= 0.8 * rate * stall_s
    assert after_stall.latency_us is not None and after_stall.latency_us.max >= (stall_s - 0.05) * 1e6
    assert after_stall.late_sends <= summary.late_sends <= summary.requests


def test_the_server_dying_mid_run_gives_the_windows_measured_so_far(private_server: PrivateServer,
                                                                     quick: Measurement) -> None:
    def stop_after_two(model: str, level: LoadLevel, index: int, window: Window) -> None:
        if index == 2:
            private_server.stop()

    measurement = dataclasses.replace(quick, stability_percentage=0.001, max_trials=40)
    with pytest.raises(RunAborted) as caught:
        run(config(private_server.endpoints.grpc, measurement, levels=(LoadLevel(concurrency=2),)), stop_after_two)
    assert "the server stopped answering during concurrency 2" in str(caught.value)
    (row,) = caught.value.partial
    assert isinstance(row, ModelResult) and row.model == "mlp_fp32"
    assert not row.result.complete and not row.result.stable
    assert 3 <= len(row.result.windows) < 40 and row.result.windows[0].throughput > 0
    assert row.result.windows[-1].requests == 0 and row.result.windows[-1].errors


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
