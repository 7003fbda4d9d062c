from pathlib import Path

import pytest

from client.power import NoMeter, PowerTrace, RaplMeter, Reading, open_meter, parse_triton_metrics, window_power

METRICS = """# HELP nv_energy_consumption GPU energy consumption in joules since the Triton Server started
# TYPE nv_energy_consumption counter
nv_energy_consumption{gpu_uuid="GPU-a"} 1200.5
nv_energy_consumption{gpu_uuid="GPU-b"} 799.5
# TYPE nv_gpu_power_usage gauge
nv_gpu_power_usage{gpu_uuid="GPU-a"} 130.25
nv_gpu_power_usage{gpu_uuid="GPU-b"} 69.75
nv_inference_count{model="m",version="1"} 5
"""


def test_triton_metrics_are_summed_over_gpus() -> None:
    assert parse_triton_metrics(METRICS) == (2000.0, 200.0)
    assert parse_triton_metrics("nv_inference_count{model=\"m\"} 3\n") == (None, None)


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


def test_unreadable_sources_give_none_with_every_reason(tmp_path: Path) -> None:
    meter = open_meter("auto", "http://127.0.0.1:9/metrics")
    if meter.source == "none":  # this machine: no GPU and no readable RAPL
        assert isinstance(meter, NoMeter)
        assert "nvml:" in meter.reason and "triton:" in meter.reason and "rapl:" in meter.reason
    assert open_meter("none", "").source == "none"


def test_window_power_joules_per_inference_and_sample_integration() -> None:
    class Fake:
        source = "nvml"
        trace = PowerTrace([(0.0, 100.0), (1.0, 100.0), (2.0, 200.0)])

    result = window_power(Fake(), Reading(0.0, 1000.0, None), Reading(2.0, 1250.0, None), 500)  # type: ignore[arg-type]
    assert result["energy_j"] == 250.0 and result["avg_w"] == 125.0
    assert result["j_per_infer"] == 0.5 and result["infer_per_j"] == 2.0
    assert result["energy_j_from_samples"] == pytest.approx(250.0)
    none = window_power(NoMeter("no GPU"), Reading(0, None, None), Reading(1, None, None), 5)
    assert none == {"source": "none", "reason": "no GPU"}
