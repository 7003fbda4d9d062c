"""client.power: meters, and the energy figures of an interval (missing means None, never 0)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from client.power import (
    NoMeter,
    NvmlMeter,
    PowerFigures,
    PowerSource,
    PowerTrace,
    RaplMeter,
    Reading,
    open_meter,
    parse_triton_energy,
    window_power,
)

METRICS = """# HELP nv_energy_consumption GPU energy consumption in joules since the Triton Server started
# TYPE nv_energy_consumption counter
nv_energy_consumption{gpu_uuid="GPU-a"} 1200.5
nv_energy_consumption{gpu_uuid="GPU-b"} 799.5
# TYPE nv_gpu_power_usage gauge
nv_gpu_power_usage{gpu_uuid="GPU-a"} 130.25
nv_gpu_power_usage{gpu_uuid="GPU-b"} 69.75
nv_inference_count{model="m",version="1"} 5
"""


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


def test_triton_energy_is_summed_over_gpus() -> None:
    assert parse_triton_energy(METRICS) == 2000.0
    assert parse_triton_energy("nv_inference_count{model=\"m\"} 3\n") is None


def test_rapl_reads_package_domains_and_survives_wraparound(tmp_path: Path) -> None:
    pkg = tmp_path / "intel-rapl:0"
    (tmp_path / "intel-rapl:0:0").mkdir(parents=True)  # a sub-domain: must not be double counted
    pkg.mkdir()
    (pkg / "max_energy_range_uj").write_text("1000000\n")
    (pkg / "energy_uj").write_text("900000\n")
    (tmp_path / "intel-rapl:0:0" / "energy_uj").write_text("5\n")
    meter = RaplMeter(tmp_path)
    start = meter.read()
    (pkg / "energy_uj").write_text("100000\n")  # wrapped: 0.1 J to the top + 0.1 J after
    end = meter.read()
    assert end.energy_j is not None and start.energy_j is not None
    assert end.energy_j - start.energy_j == pytest.approx(0.2)


def test_auto_source_gives_consistent_readings_or_none_with_every_reason() -> None:
    """Whatever `auto` finds on this machine, its readings are consistent: a real meter's energy counter
    rises while the machine runs and its power figures are positive; `none` names every source it tried."""
    meter = open_meter(PowerSource.AUTO, "http://127.0.0.1:9/metrics")  # nothing listens there: triton fails
    try:
        first = meter.read()
        time.sleep(0.5)
        second = meter.read()
    finally:
        meter.close()
    assert second.t > first.t
    figures = window_power(meter, first, second, 100)
    if meter.source is PowerSource.NONE:
        assert isinstance(meter, NoMeter) and meter.reason is not None
        # Tried in order nvml, triton, rapl; each failure is part of the reason.
        positions = [meter.reason.find(f"{name}: ") for name in ("nvml", "triton", "rapl")]
        assert positions[0] == 0 and positions[0] < positions[1] < positions[2], meter.reason
        assert first.energy_j is None and second.energy_j is None
        assert figures == PowerFigures(source=PowerSource.NONE, reason=meter.reason)
        return
    assert meter.source in (PowerSource.NVML, PowerSource.RAPL) and meter.reason is None
    assert first.energy_j is not None and second.energy_j is not None
    assert second.energy_j > first.energy_j  # a powered machine uses energy in half a second
    assert figures.source is meter.source and figures.reason is None
    assert figures.energy_j is not None and figures.energy_j == pytest.approx(second.energy_j - first.energy_j)
    assert figures.avg_w is not None and figures.avg_w > 0
    assert figures.j_per_infer == pytest.approx(figures.energy_j / 100)
    assert figures.infer_per_j == pytest.approx(100 / figures.energy_j)
    if meter.trace is not None:  # NVML samples instant power in the background
        times = [t for t, _ in meter.trace.samples]
        assert len(times) >= 2 and times == sorted(times)
        assert all(watts > 0 for _, watts in meter.trace.samples)
        assert figures.energy_j_from_samples is not None and figures.energy_j_from_samples > 0


def test_a_source_asked_for_by_name_is_the_only_one_tried() -> None:
    disabled = open_meter(PowerSource.NONE, "")
    assert disabled.source is PowerSource.NONE and disabled.reason == "disabled by --power-source none"
    triton = open_meter(PowerSource.TRITON, "http://127.0.0.1:9/metrics")
    assert triton.source is PowerSource.NONE and triton.reason is not None
    assert triton.reason.startswith("triton: cannot read http://127.0.0.1:9/metrics")
    assert "nvml" not in triton.reason and "rapl" not in triton.reason


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


def test_an_nvml_meter_that_fails_to_open_releases_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    # A GPU whose energy counter cannot be read: the meter refuses, and NVML is shut down again.
    import sys
    import types

    calls: list[str] = []

    class NVMLError(Exception):
        pass

    fake = types.SimpleNamespace(
        NVMLError=NVMLError,
        nvmlInit=lambda: calls.append("init"),
        nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlDeviceGetCount=lambda: 1,
        nvmlDeviceGetHandleByIndex=lambda i: object(),
        nvmlDeviceGetTotalEnergyConsumption=lambda handle: (_ for _ in ()).throw(NVMLError("not supported")),
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    with pytest.raises(NVMLError, match="not supported"):
        NvmlMeter()
    assert calls == ["init", "shutdown"]
