"""Per-GPU energy (issue 26): on a 4-GPU host, NVML and Triton's metric count exactly the GPUs chosen
(--gpus, the models' instance groups, CUDA_VISIBLE_DEVICES, else every GPU), each GPU's W and J kept
apart; joules per inference divide their total. A stand-in pynvml of 4 GPUs and Prometheus text with 4
`gpu_uuid` series on loopback stand for the host (tests/client/test_power.py's stand-ins)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from client.cli import main, parse_config
from client.engine import LoadLevel, Measurement
from client.errors import PerfClientError
from client.html_report import write_html
from client.power import (
    GpuSelection,
    NvmlMeter,
    PowerSource,
    TritonMetricsMeter,
    open_cross_checks,
    open_meter,
    window_power,
)
from client.report import documents, table, write_json
from client.session import ModelResult, SessionConfig, choose_gpus, run, sharing
from tests.client.test_power import FakeNvml, MetricsServer, rapl_tree, use_nvml
from tests.client.test_report import level_result
from tests.helpers.servers import Endpoints

UUIDS = [f"GPU-{n}a0c{n}e7-0000-4000-8000-00000000000{n}" for n in range(4)]


class FourGpus(FakeNvml):
    """The stand-in pynvml with UUIDs (bytes, as older pynvml gives them)."""

    def __init__(self) -> None:
        super().__init__([1_000_000, 2_000_000, 3_000_000, 4_000_000], [75_000] * 4, instant="absent")

    def nvmlDeviceGetUUID(self, handle: int) -> bytes:
        return UUIDS[handle].encode()


def metrics_text(joules: list[float]) -> str:
    lines = ["# TYPE nv_energy_consumption counter"]
    lines += [f'nv_energy_consumption{{gpu_uuid="{uuid}"}} {j}' for uuid, j in zip(UUIDS, joules, strict=True)]
    return "\n".join([*lines, 'nv_inference_count{model="m",version="1"} 5', ""])


@pytest.fixture
def four(monkeypatch: pytest.MonkeyPatch) -> FourGpus:
    fake = FourGpus()
    use_nvml(monkeypatch, fake)
    return fake


@pytest.fixture
def metrics() -> Iterator[MetricsServer]:
    server = MetricsServer()
    server.text = metrics_text([1000.0, 2000.0, 3000.0, 4000.0])
    yield server
    server.close()


@pytest.mark.parametrize("ids", [("1", "3"), (UUIDS[3], UUIDS[1]), ("3", UUIDS[1])])
def test_nvml_and_tritons_metric_meter_the_same_chosen_gpus(four: FourGpus, metrics: MetricsServer,
                                                            ids: tuple[str, ...]) -> None:
    chosen = GpuSelection(ids, "--gpus")
    nvml = NvmlMeter(sample_interval=10.0, gpus=chosen)
    triton = TritonMetricsMeter(metrics.url, chosen)
    try:
        assert nvml.gpus == triton.gpus == [UUIDS[1], UUIDS[3]]
        reading = nvml.read()
        assert reading.energy_j == 6000.0 and dict(reading.per_gpu) == {UUIDS[1]: 2000.0, UUIDS[3]: 4000.0}
        assert triton.read().per_gpu == reading.per_gpu  # before: 10000 J, every GPU, no per-GPU figure
    finally:
        nvml.close()


def test_every_gpu_by_default_and_an_absent_gpu_is_refused_naming_those_there(four: FourGpus,
                                                                              metrics: MetricsServer) -> None:
    meter = open_meter(PowerSource.NVML, metrics.url)
    try:
        assert meter.read().energy_j == 10000.0
    finally:
        meter.close()
    refused = open_meter(PowerSource.NVML, metrics.url, gpus=GpuSelection(("5",), "--gpus"))
    assert refused.reason is not None and "GPU 5 (--gpus) is not here" in refused.reason
    assert f"3 {UUIDS[3]}" in refused.reason and four.calls[-1] == "shutdown"
    with pytest.raises(RuntimeError, match="GPU GPU-x"):
        TritonMetricsMeter(metrics.url, GpuSelection(("GPU-x",), "--gpus"))


def test_gpus_named_and_absent_are_not_metered_on_the_cpu_instead(four: FourGpus, tmp_path: Path) -> None:
    # auto falls back nvml -> triton -> rapl; with GPUs named, RAPL (the CPU packages) would stand in for them.
    root = rapl_tree(tmp_path / "rapl", {0: (1000, 10**9)})
    meter = open_meter(PowerSource.AUTO, "http://127.0.0.1:1/metrics", rapl_root=root,
                       gpus=GpuSelection(("99",), "--gpus"))
    assert meter.source is PowerSource.NONE and meter.reason is not None
    assert "GPU 99 (--gpus) is not here" in meter.reason
    assert open_meter(PowerSource.AUTO, "http://127.0.0.1:1/metrics", rapl_root=root).source is PowerSource.NVML


@pytest.mark.server
def test_perfclient_gpus_that_no_meter_counts_is_one_line(endpoints: Endpoints, metrics: MetricsServer,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["-m", "mlp_fp32", "-u", endpoints.grpc, "--concurrency", "1", "--metrics-url", metrics.url,
                 "--gpus", "99", "--no-progress"]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("perfclient: error: --gpus 99: no meter counts these GPUs (") and "GPU 99" in line

def test_the_cross_check_counts_the_same_gpus(four: FourGpus, metrics: MetricsServer) -> None:
    chosen = GpuSelection(("0", "2"), "instance groups of m")
    meter = open_meter(PowerSource.NVML, metrics.url, gpus=chosen)
    (cross,) = open_cross_checks(meter, metrics.url, chosen)
    try:
        assert cross.read().energy_j == meter.read().energy_j == 4000.0
    finally:
        meter.close()


def test_the_gpus_chosen_instance_groups_then_cuda_visible_devices_then_every_gpu() -> None:
    on_1 = {"instance_group": [{"kind": "KIND_GPU", "count": 2, "gpus": [1]}]}
    on_3 = {"instance_group": [{"kind": "KIND_GPU", "count": 1, "gpus": [3]},
                               {"kind": "KIND_CPU", "count": 1}]}
    cpu = {"instance_group": [{"kind": "KIND_CPU", "count": 1}]}
    env = {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert choose_gpus(None, {"a": on_1, "b": on_3}, env) == GpuSelection(("1", "3"), "instance groups of a, b")
    assert choose_gpus(("0",), {"a": on_1}, env) == GpuSelection(("0",), "--gpus")
    assert choose_gpus(None, {"c": cpu}, env) == GpuSelection(("2", "3"), "CUDA_VISIBLE_DEVICES")
    assert choose_gpus(None, {"c": cpu}, {}) == GpuSelection()
    assert choose_gpus(None, {}, {"CUDA_VISIBLE_DEVICES": "garbage!"}) == GpuSelection()


def test_gpus_flag_takes_indices_and_uuids_and_refuses_the_rest() -> None:
    assert parse_config(["-m", "m", "--gpus", f"0,3,{UUIDS[2]}"]).session.gpus == ("0", "3", UUIDS[2])
    with pytest.raises(PerfClientError, match="--gpus 'a,b': expected GPU indices or UUIDs"):
        parse_config(["-m", "m", "--gpus", "a,b"])


def test_json_html_and_table_show_each_gpus_w_and_j_and_the_selected_total(four: FourGpus,
                                                                           tmp_path: Path) -> None:
    chosen = GpuSelection(("0", "3"), "--gpus")
    meter = NvmlMeter(sample_interval=10.0, gpus=chosen)
    try:
        before = meter.read()
        four.energy_mj = [1_150_000, 2_999_000, 3_999_000, 4_450_000]  # +150 J and +450 J on 0 and 3; 1, 2 busy
        after = meter.read()
    finally:
        meter.close()
    before, after = dataclasses.replace(before, t=100.0), dataclasses.replace(after, t=110.0)  # 10 s apart
    power = window_power(meter, before, after, inferences=1200)
    assert power.energy_j == 600.0 and power.avg_w == 60.0 and power.j_per_infer == 0.5  # GPUs 1 and 2 left out
    rows = [ModelResult("m", level_result(LoadLevel(concurrency=4), power=power))]
    config = SessionConfig(models=("m",), url="localhost:8001", gpus=("0", "3"))
    write_json(tmp_path / "run.json", documents(config, rows))
    doc = json.loads((tmp_path / "run.json").read_text())["results"][0]["power"]
    assert doc["gpu_selection"] == "0,3 (--gpus)"
    assert doc["gpus"] == [{"gpu": UUIDS[0], "avg_w": 15.0, "energy_j": 150.0},
                           {"gpu": UUIDS[3], "avg_w": 45.0, "energy_j": 450.0}]
    assert (doc["avg_w"], doc["energy_j"], doc["j_per_infer"]) == (60.0, 600.0, 0.5)
    write_html(tmp_path / "run.html", config, rows)
    page = (tmp_path / "run.html").read_text()
    assert "<h2>Energy per GPU</h2>" in page and "Metered: 0,3 (--gpus)." in page
    for uuid, watts, joules in ((UUIDS[0], "15.0", "150.00"), (UUIDS[3], "45.0", "450.00"),
                                ("<b>total</b>", "60.0", "600.00")):
        assert f"<td>{uuid}</td><td>{watts}</td><td>{joules}</td>" in page.replace('<td class="text">', "<td>")
    assert UUIDS[1] not in page and UUIDS[2] not in page
    text = table(rows)
    assert "GPUs metered: 0,3 (--gpus)" in text
    assert f"{UUIDS[0]} 15.0 W 150.0 J, {UUIDS[3]} 45.0 W 450.0 J; total 60.0 W 600.0 J" in text


@pytest.mark.server
@pytest.mark.parametrize(("gpus", "env", "expected"), [
    (("1", "3"), "0", "1,3 (--gpus)"),
    (None, "2", "2 (CUDA_VISIBLE_DEVICES)"),  # the tiny model's instance group is KIND_CPU: it names no GPU
])
def test_a_session_meters_the_chosen_gpus_of_tritons_metric(
        endpoints: Endpoints, metrics: MetricsServer, monkeypatch: pytest.MonkeyPatch, gpus: tuple[str, ...] | None,
        env: str, expected: str) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", env)
    measurement = Measurement(measurement_ms=300, stability_percentage=90, max_trials=2)
    (row,) = run(SessionConfig(models=("mlp_fp32",), url=endpoints.grpc, measurement=measurement,
                               power_source=PowerSource.TRITON, metrics_url=metrics.url, gpus=gpus))
    power = row.result.power
    assert power.gpu_selection == expected
    picked = [UUIDS[int(i)] for i in (gpus or (env,))]
    assert [g.gpu for g in power.gpus] == picked  # a counter that did not move: 0 J each, no J/infer
    assert power.energy_j == 0.0 and power.infer_per_j is None


def test_other_models_on_the_metered_gpus_are_said_in_one_line() -> None:
    chosen = GpuSelection(("1", "3"), "instance groups of a")
    others = {"b": {"instance_group": [{"kind": "KIND_GPU", "count": 1, "gpus": [3]}]},
              "c": {"instance_group": [{"kind": "KIND_GPU", "count": 1, "gpus": [0]}]},
              "d": {"instance_group": [{"kind": "KIND_CPU", "count": 4}]},
              "e": {"instance_group": [{"kind": "KIND_GPU", "count": 1}]}}  # every GPU
    assert sharing(chosen, others) == ("the GPUs metered (1,3 (instance groups of a)) also run b, e: their work is "
                                       "in the energy figures")
    assert sharing(chosen, {k: others[k] for k in ("c", "d")}) is None
    assert sharing(GpuSelection(), {"c": others["c"]}) is not None  # every GPU metered: c's GPU among them
