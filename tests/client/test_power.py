"""client.power: meters, and the energy figures of an interval (missing means None, never 0).

Every source is tested the same on any host: NVML through a stand-in `pynvml` module, RAPL through a
powercap tree in a temporary folder, Triton's metrics through Prometheus text served on loopback. Only the
`gpu`-marked test reads a real GPU's counter (skipped where there is none)."""

from __future__ import annotations

import http.server
import re
import socket
import sys
import threading
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from client.power import (
    NoMeter,
    NvmlMeter,
    PowerFigures,
    PowerSource,
    PowerTrace,
    RaplMeter,
    Reading,
    TritonMetricsMeter,
    open_cross_checks,
    open_meter,
    parse_triton_energy,
    window_power,
)
from tests.helpers.waiting import wait_until

METRICS = """# HELP nv_energy_consumption GPU energy consumption in joules since the Triton Server started
# TYPE nv_energy_consumption counter
nv_energy_consumption{gpu_uuid="GPU-a"} 1200.5
nv_energy_consumption{gpu_uuid="GPU-b"} 799.5
# TYPE nv_gpu_power_usage gauge
nv_gpu_power_usage{gpu_uuid="GPU-a"} 130.25
nv_gpu_power_usage{gpu_uuid="GPU-b"} 69.75
nv_inference_count{model="m",version="1"} 5
"""
NO_GPU_METRICS = 'nv_inference_count{model="m",version="1"} 5\n'  # a CPU-only Triton: no energy metric


# --- stand-ins ---------------------------------------------------------------------------------------------
class NVMLError(Exception):
    pass


class FakeNvml(types.ModuleType):
    """A stand-in `pynvml`: per GPU a total-energy counter (mJ) and a 1 s average power (mW). `instant` is how
    the NVML_FI_DEV_POWER_INSTANT field answers: "mw" with `instant_mw`, "error" (an NVML error), "failed"
    (a per-field error status), "absent" (a pynvml too old to name the field)."""

    NVMLError = NVMLError

    def __init__(self, energy_mj: list[int], power_mw: list[int], *, instant: str = "mw",
                 instant_mw: list[int] | None = None, init_error: str | None = None) -> None:
        super().__init__("pynvml")
        self.energy_mj, self.power_mw, self.instant, self.instant_mw = energy_mj, power_mw, instant, instant_mw
        self.init_error = init_error
        self.calls: list[str] = []
        if instant != "absent":
            self.NVML_FI_DEV_POWER_INSTANT = 186

    def nvmlInit(self) -> None:
        self.calls.append("init")
        if self.init_error is not None:
            raise NVMLError(self.init_error)

    def nvmlShutdown(self) -> None:
        self.calls.append("shutdown")

    def nvmlDeviceGetCount(self) -> int:
        return len(self.energy_mj)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: int) -> int:
        return self.energy_mj[handle]

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
        return self.power_mw[handle]

    def nvmlDeviceGetFieldValues(self, handle: int, field_ids: list[int]) -> list[Any]:
        if self.instant == "error":
            raise NVMLError("Not Supported")
        status = 0 if self.instant == "mw" else 3
        value = self.instant_mw[handle] if self.instant_mw is not None else 0
        return [types.SimpleNamespace(nvmlReturn=status, value=types.SimpleNamespace(uiVal=value))]


def use_nvml(monkeypatch: pytest.MonkeyPatch, fake: FakeNvml | None) -> None:
    """`import pynvml` gives `fake` from now on; None: the module is not installed."""
    monkeypatch.setitem(sys.modules, "pynvml", fake)  # type: ignore[arg-type]  # None: the import fails


def rapl_tree(root: Path, packages: dict[int, tuple[int, int]]) -> Path:
    """A powercap tree: package `index` → (energy_uj, max_energy_range_uj), each with a sub-domain."""
    for index, (energy, top) in packages.items():
        package = root / f"intel-rapl:{index}"
        package.mkdir(parents=True)
        (root / f"intel-rapl:{index}:0").mkdir()  # a sub-domain (core, uncore): inside the package's count
        (root / f"intel-rapl:{index}:0" / "energy_uj").write_text("5\n")
        (package / "energy_uj").write_text(f"{energy}\n")
        (package / "max_energy_range_uj").write_text(f"{top}\n")
    return root


def set_rapl(root: Path, index: int, energy_uj: int) -> None:
    (root / f"intel-rapl:{index}" / "energy_uj").write_text(f"{energy_uj}\n")


class MetricsServer:
    """Prometheus text on loopback, as Triton's metrics port serves it; `text` may change between reads."""

    def __init__(self) -> None:
        self.text = METRICS
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # http.server's name
                body = owner.text.encode()
                self.send_response(200 if self.path == "/metrics" else 404)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # http.server's signature
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"
        self.thread = threading.Thread(target=self.server.serve_forever, name="metrics", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


@pytest.fixture
def metrics() -> Iterator[MetricsServer]:
    server = MetricsServer()
    yield server
    server.close()


@pytest.fixture
def dead_url() -> str:
    """A loopback URL where nothing listens (a port just closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/metrics"


class SampledMeter:
    """A meter with instant-power samples (as NVML's), for window_power."""

    source = PowerSource.NVML
    reason = None

    def __init__(self, samples: list[tuple[float, float]]) -> None:
        self.trace: PowerTrace | None = PowerTrace(samples)

    def read(self) -> Reading:
        raise AssertionError("window_power takes readings, it does not read")

    def close(self) -> None:
        pass


# --- Triton's metrics --------------------------------------------------------------------------------------
def test_triton_energy_is_summed_over_gpus() -> None:
    assert parse_triton_energy(METRICS) == 2000.0
    assert parse_triton_energy(NO_GPU_METRICS) is None


def test_the_metrics_meter_reads_every_gpus_counter_over_http(metrics: MetricsServer) -> None:
    meter = TritonMetricsMeter(metrics.url)
    try:
        first = meter.read()
        metrics.text = METRICS.replace("1200.5", "1300.5").replace("799.5", "849.5")  # +100 J and +50 J
        second = meter.read()
    finally:
        meter.close()
    assert (first.energy_j, second.energy_j) == (2000.0, 2150.0) and second.t >= first.t
    assert meter.source is PowerSource.TRITON and meter.trace is None and meter.reason is None


def test_a_metrics_endpoint_without_gpu_energy_or_unreachable_is_refused(metrics: MetricsServer,
                                                                         dead_url: str) -> None:
    metrics.text = NO_GPU_METRICS
    with pytest.raises(RuntimeError, match="has no nv_energy_consumption"):
        TritonMetricsMeter(metrics.url)
    with pytest.raises(RuntimeError, match=f"cannot read {re.escape(dead_url)}"):
        TritonMetricsMeter(dead_url)
    with pytest.raises(RuntimeError, match=r"cannot read .*/nothing.*404"):
        TritonMetricsMeter(metrics.url.replace("/metrics", "/nothing"))


# --- RAPL --------------------------------------------------------------------------------------------------
def test_rapl_reads_package_domains_and_survives_wraparound(tmp_path: Path) -> None:
    root = rapl_tree(tmp_path, {0: (900_000, 1_000_000), 1: (10, 1_000_000)})
    meter = RaplMeter(root)
    assert [d.name for d in meter.domains] == ["intel-rapl:0", "intel-rapl:1"]  # packages, no sub-domain
    start = meter.read()
    set_rapl(root, 0, 100_000)  # wrapped: 0.1 J to the top + 0.1 J after
    set_rapl(root, 1, 300_010)  # +0.3 J
    end = meter.read()
    assert start.energy_j is not None and end.energy_j is not None
    assert end.energy_j - start.energy_j == pytest.approx(0.5)
    assert end.t >= start.t and meter.trace is None


@pytest.mark.parametrize("how", ["no domains", "energy unreadable", "range unreadable", "not a number"])
def test_unreadable_rapl_is_refused_with_the_path(tmp_path: Path, how: str) -> None:
    # A folder where a file should be fails to read as root too (root reads a chmod 000 file).
    root = rapl_tree(tmp_path, {} if how == "no domains" else {0: (1, 1_000_000)})
    package = root / "intel-rapl:0"
    if how == "energy unreadable":
        (package / "energy_uj").unlink()
        (package / "energy_uj").mkdir()
    elif how == "range unreadable":
        (package / "max_energy_range_uj").unlink()
        (package / "max_energy_range_uj").mkdir()
    elif how == "not a number":
        (package / "energy_uj").write_text("n/a\n")
    message = f"no RAPL domains under {root}" if how == "no domains" else f"{package / 'energy_uj'} is not readable"
    with pytest.raises(RuntimeError, match=re.escape(message)):
        RaplMeter(root)


# --- NVML --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("instant", "watts"), [("mw", 150.0), ("error", 60.0), ("failed", 60.0), ("absent", 60.0)])
def test_nvml_energy_counter_and_instant_power_samples(monkeypatch: pytest.MonkeyPatch, instant: str,
                                                      watts: float) -> None:
    # Two GPUs: energy from the counter (mJ, summed); the samples from the instant-power field where NVML
    # answers it (100 + 50 W), else from the power average (40 + 20 W).
    fake = FakeNvml([1_000_000, 500_000], [40_000, 20_000], instant=instant, instant_mw=[100_000, 50_000])
    use_nvml(monkeypatch, fake)
    meter = NvmlMeter(sample_interval=0.01)
    try:
        first = meter.read()
        fake.energy_mj = [1_250_000, 600_000]  # +250 J and +100 J
        second = meter.read()
        assert meter.trace is not None
        trace = meter.trace
        wait_until(lambda: len(trace.samples) >= 3, what="three power samples")
    finally:
        meter.close()
    assert fake.calls == ["init", "shutdown"]
    assert (first.energy_j, second.energy_j) == (1500.0, 1850.0) and second.t >= first.t
    samples = list(trace.samples)
    assert [w for _, w in samples] == [watts] * len(samples)
    assert [t for t, _ in samples] == sorted(t for t, _ in samples)
    assert not meter._thread.is_alive()  # close() stopped the sampler
    # The window's energy is the counter's; the samples give the cross-check by integration.
    start, end = samples[0][0], samples[-1][0]
    figures = window_power(meter, Reading(start, first.energy_j), Reading(end, second.energy_j), 35)
    assert figures.energy_j == 350.0 and figures.j_per_infer == pytest.approx(10.0)
    assert figures.energy_j_from_samples == pytest.approx(watts * (end - start))


def test_nvml_without_a_gpu_is_refused_and_released(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNvml([], [])
    use_nvml(monkeypatch, fake)
    with pytest.raises(RuntimeError, match="NVML found no GPU"):
        NvmlMeter()
    assert fake.calls == ["init", "shutdown"]


def test_an_nvml_meter_that_fails_to_open_releases_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    # A GPU whose energy counter cannot be read: the meter refuses, and NVML is shut down again.
    fake = FakeNvml([0], [0])

    def unsupported(handle: int) -> int:
        raise NVMLError("not supported")

    fake.nvmlDeviceGetTotalEnergyConsumption = unsupported  # type: ignore[method-assign]
    use_nvml(monkeypatch, fake)
    with pytest.raises(NVMLError, match="not supported"):
        NvmlMeter()
    assert fake.calls == ["init", "shutdown"]


@pytest.mark.gpu
def test_a_real_gpus_energy_counter_rises() -> None:
    """On a GPU host: the real counter (updated every 20-100 ms) rises, and instant power is positive."""
    meter = NvmlMeter(sample_interval=0.01)
    try:
        first = meter.read()
        assert first.energy_j is not None
        second = wait_until(lambda: (r := meter.read()).energy_j is not None and r.energy_j > first.energy_j and r,
                            what="the GPU's energy counter rising", timeout_s=30)
        assert meter.trace is not None
        trace = meter.trace
        wait_until(lambda: len(trace.samples) >= 2, what="two power samples")
    finally:
        meter.close()
    assert second.t > first.t and all(watts > 0 for _, watts in trace.samples)


# --- choosing a source ---------------------------------------------------------------------------------------
def test_auto_takes_nvml_first(monkeypatch: pytest.MonkeyPatch, metrics: MetricsServer, tmp_path: Path) -> None:
    fake = FakeNvml([1_000], [1_000])
    use_nvml(monkeypatch, fake)
    meter = open_meter(PowerSource.AUTO, metrics.url, rapl_root=rapl_tree(tmp_path, {0: (1, 1_000_000)}))
    try:
        assert isinstance(meter, NvmlMeter) and meter.source is PowerSource.NVML and meter.reason is None
        checks = open_cross_checks(meter, metrics.url)  # Triton's counter, read at the same instants
        assert [c.source for c in checks] == [PowerSource.TRITON] and checks[0].read().energy_j == 2000.0
    finally:
        meter.close()


@pytest.mark.parametrize("nvml", ["not installed", "no driver"])
def test_auto_without_nvml_takes_tritons_metrics(monkeypatch: pytest.MonkeyPatch, metrics: MetricsServer,
                                                 tmp_path: Path, nvml: str) -> None:
    use_nvml(monkeypatch, None if nvml == "not installed" else
             FakeNvml([], [], init_error="NVML Shared Library Not Found"))
    meter = open_meter(PowerSource.AUTO, metrics.url, rapl_root=rapl_tree(tmp_path, {0: (1, 1_000_000)}))
    assert isinstance(meter, TritonMetricsMeter) and meter.read().energy_j == 2000.0
    assert open_cross_checks(meter, metrics.url) == []  # cross-checks are for NVML only


def test_auto_without_nvml_or_gpu_metrics_takes_rapl(monkeypatch: pytest.MonkeyPatch, metrics: MetricsServer,
                                                     tmp_path: Path) -> None:
    use_nvml(monkeypatch, None)
    metrics.text = NO_GPU_METRICS
    root = rapl_tree(tmp_path, {0: (1_000_000, 2_000_000)})
    meter = open_meter(PowerSource.AUTO, metrics.url, rapl_root=root)
    assert isinstance(meter, RaplMeter) and meter.reason is None
    first = meter.read()
    set_rapl(root, 0, 500_000)  # wrapped: 1 J to the top of its 2 J range, then 0.5 J
    second = meter.read()
    figures = window_power(meter, first, second, 3)
    assert figures.source is PowerSource.RAPL and figures.energy_j == pytest.approx(1.5)
    assert figures.infer_per_j == pytest.approx(2.0) and figures.energy_j_from_samples is None


def test_auto_with_nothing_is_none_with_every_reason_in_order(monkeypatch: pytest.MonkeyPatch, dead_url: str,
                                                              tmp_path: Path) -> None:
    use_nvml(monkeypatch, FakeNvml([], [], init_error="NVML Shared Library Not Found"))
    meter = open_meter(PowerSource.AUTO, dead_url, rapl_root=tmp_path)
    assert isinstance(meter, NoMeter) and meter.source is PowerSource.NONE and meter.reason is not None
    # Tried in order nvml, triton, rapl; each failure is part of the reason.
    assert meter.reason.startswith(f"nvml: NVML Shared Library Not Found; triton: cannot read {dead_url}: ")
    assert meter.reason.endswith(f"; rapl: no RAPL domains under {tmp_path}"), meter.reason
    first, second = meter.read(), meter.read()
    assert first.energy_j is None and second.energy_j is None and second.t >= first.t
    assert window_power(meter, first, second, 100) == PowerFigures(source=PowerSource.NONE, reason=meter.reason)


def test_a_source_asked_for_by_name_is_the_only_one_tried(monkeypatch: pytest.MonkeyPatch, dead_url: str,
                                                          tmp_path: Path) -> None:
    use_nvml(monkeypatch, FakeNvml([1_000], [1_000]))  # available, and still not tried
    disabled = open_meter(PowerSource.NONE, "")
    assert disabled.source is PowerSource.NONE and disabled.reason == "disabled by --power-source none"
    triton = open_meter(PowerSource.TRITON, dead_url, rapl_root=rapl_tree(tmp_path, {0: (1, 1_000_000)}))
    assert triton.source is PowerSource.NONE and triton.reason is not None
    assert triton.reason.startswith(f"triton: cannot read {dead_url}")
    assert "nvml" not in triton.reason and "rapl" not in triton.reason
    rapl = open_meter(PowerSource.RAPL, dead_url, rapl_root=tmp_path / "absent")
    assert rapl.reason == f"rapl: no RAPL domains under {tmp_path / 'absent'}"


# --- the figures of a window ---------------------------------------------------------------------------------
def test_joules_per_inference_samples_and_cross_checks() -> None:
    meter = SampledMeter([(0.0, 100.0), (1.0, 100.0), (2.0, 200.0)])
    cross = [(PowerSource.TRITON, Reading(0.0, 50.0), Reading(2.0, 298.0)),
             (PowerSource.RAPL, Reading(0.0, None), Reading(2.0, None))]
    p = window_power(meter, Reading(0.0, 1000.0), Reading(2.0, 1250.0), 500, cross)
    assert p.source is PowerSource.NVML and p.reason is None
    assert p.energy_j == 250.0 and p.avg_w == 125.0
    assert p.j_per_infer == 0.5 and p.infer_per_j == 2.0
    assert p.energy_j_from_samples == pytest.approx(250.0)
    assert p.cross_checks == {PowerSource.TRITON: 248.0, PowerSource.RAPL: None}


def test_no_energy_is_none_everywhere_with_the_reason() -> None:
    p = window_power(NoMeter("no GPU"), Reading(0, None), Reading(1, None), 5)
    assert p == PowerFigures(source=PowerSource.NONE, reason="no GPU")
    assert p.avg_w is None and p.energy_j is None and p.j_per_infer is None and p.infer_per_j is None


def test_no_inference_and_no_energy_used_give_none_ratios() -> None:
    meter = SampledMeter([])
    p = window_power(meter, Reading(0.0, 10.0), Reading(1.0, 10.0), 0)
    assert p.energy_j == 0.0 and p.j_per_infer is None and p.infer_per_j is None
    assert p.energy_j_from_samples is None  # fewer than two samples: nothing to integrate
