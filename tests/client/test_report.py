"""client.report: typed results become the documented JSON, perf_analyzer's CSV and the table."""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path

import pytest

from client.engine import Distribution, LevelResult, LoadLevel
from client.power import PowerFigures, PowerSource
from client.report import CSV_COLUMNS, documents, power_dict, result_dict, table, write_csv, write_json
from client.server_stats import ServerBreakdown
from client.session import ModelResult, SessionConfig
from client.stats import Latency, Tally, Window, close, merge

LATENCY = Latency(avg=1100.0, p50=1000.0, p90=1500.0, p95=1700.0, p99=2500.0, max=4000.0)
SERVER = ServerBreakdown(requests=300, queue_us=100.0, compute_input_us=10.0, compute_infer_us=700.0,
                         compute_output_us=20.0, avg_batch=2.5)
NVML = PowerFigures(source=PowerSource.NVML, avg_w=150.0, energy_j=300.0, j_per_infer=0.25, infer_per_j=4.0,
                    energy_j_from_samples=296.0, cross_checks={PowerSource.TRITON: 301.0})
NONE = PowerFigures(source=PowerSource.NONE, reason="nvml: no GPU")


def level_result(level: LoadLevel, power: PowerFigures = NVML, server: ServerBreakdown = SERVER,
                 latency: Latency | None = LATENCY) -> LevelResult:
    windows = tuple(Window(i * 10**9, (i + 1) * 10**9, 100, 200, 200.0, latency, {}) for i in range(4))
    summary = Window(10**9, 4 * 10**9, 300, 600, 200.0, latency, {"timeout": 2}, late_sends=3)
    return LevelResult(level=level, windows=windows, summary=summary, stable=True, server=server, power=power)


def test_closed_loop_json_keeps_the_documented_keys() -> None:
    doc = result_dict(level_result(LoadLevel(concurrency=8)))
    assert list(doc) == ["concurrency", "throughput", "latency_us", "requests", "errors", "retries", "stable",
                         "partial", "windows", "window_seconds", "server", "power"]
    assert doc["partial"] is False
    assert doc["latency_us"] == {"avg": 1100.0, "p50": 1000.0, "p90": 1500.0, "p95": 1700.0, "p99": 2500.0,
                                 "max": 4000.0}
    assert doc["server"] == {"queue_us": 100.0, "compute_input_us": 10.0, "compute_infer_us": 700.0,
                             "compute_output_us": 20.0, "avg_batch": 2.5}
    assert doc["power"] == {"source": "nvml", "avg_w": 150.0, "energy_j": 300.0, "j_per_infer": 0.25,
                            "infer_per_j": 4.0, "energy_j_from_samples": 296.0, "energy_j_from_triton": 301.0}
    assert doc["windows"] == 4 and doc["window_seconds"] == [1.0] * 4 and doc["errors"] == {"timeout": 2}
    json.dumps(doc)  # plain JSON types only


def test_open_loop_json_and_missing_figures() -> None:
    doc = result_dict(level_result(LoadLevel(request_rate=50.0, distribution=Distribution.POISSON), power=NONE,
                                   server=ServerBreakdown(requests=0), latency=None))
    assert (doc["request_rate"], doc["distribution"], doc["late_sends"]) == (50.0, "poisson", 3)
    assert (doc["dropped_sends"], doc["max_send_lag_us"], doc["max_inflight"]) == (0, None, 1024)
    assert doc["power"] == {"source": "none", "reason": "nvml: no GPU"}
    assert doc["latency_us"] is None and doc["server"]["queue_us"] is None and doc["server"]["avg_batch"] is None
    assert power_dict(PowerFigures(source=PowerSource.NVML, energy_j=1.0, avg_w=2.0,
                                   cross_checks={PowerSource.TRITON: None})) == {
        "source": "nvml", "avg_w": 2.0, "energy_j": 1.0, "j_per_infer": None, "infer_per_j": None}


def test_one_model_is_one_document_several_are_runs(tmp_path: Path) -> None:
    config = SessionConfig(models=("a", "b"), url="h:8001", batch=2)
    rows = [ModelResult("a", level_result(LoadLevel(concurrency=1))),
            ModelResult("b", level_result(LoadLevel(concurrency=1)))]
    write_json(tmp_path / "one.json", documents(config, rows[:1]))
    one = json.loads((tmp_path / "one.json").read_text())
    assert (one["model"], one["protocol"], one["url"], one["batch_size"]) == ("a", "grpc", "h:8001", 2)
    assert "error" not in one and len(one["results"]) == 1
    write_json(tmp_path / "two.json", documents(config, rows, error="stopped"))
    two = json.loads((tmp_path / "two.json").read_text())
    assert [d["model"] for d in two["runs"]] == ["a", "b"] and all(d["error"] == "stopped" for d in two["runs"])
    empty = documents(config, [], error="stopped")
    assert empty == [{"model": "a", "protocol": "grpc", "url": "h:8001", "batch_size": 2, "seed": config.seed,
                      "results": [], "error": "stopped"}]


def test_csv_has_perf_analyzers_verbose_columns(tmp_path: Path) -> None:
    write_csv(tmp_path / "r.csv", [ModelResult("m", level_result(LoadLevel(concurrency=4))),
                                   ModelResult("m", level_result(LoadLevel(concurrency=8),
                                                                 server=ServerBreakdown(requests=0)))])
    header, full, missing = list(csv.reader((tmp_path / "r.csv").open(newline="")))
    assert header == CSV_COLUMNS
    row = dict(zip(header, full, strict=True))
    assert row["Concurrency"] == "4" and float(row["Inferences/Second"]) == 200.0
    assert row["Network+Server Send/Recv"] == "270"  # avg latency minus the server's own times
    assert (row["Server Queue"], row["p50 latency"], row["p99 latency"], row["Avg latency"]) == (
        "100", "1000", "2500", "1100")
    unmeasured = dict(zip(header, missing, strict=True))
    assert unmeasured["Server Queue"] == "" and unmeasured["Network+Server Send/Recv"] == ""
    # Client send/recv are not timed apart: empty cells, never a made-up 0.
    assert all(row[k] == "" for k in ("Client Send", "Client Recv", "request/response", "response wait"))
    write_csv(tmp_path / "o.csv", [ModelResult("m", level_result(LoadLevel(request_rate=5.0)))])
    assert next(csv.reader((tmp_path / "o.csv").open()))[0] == "Request Rate"


def at(model: str, concurrency: int, throughput: float) -> ModelResult:
    r = level_result(LoadLevel(concurrency=concurrency))
    return ModelResult(model, dataclasses.replace(r, summary=dataclasses.replace(r.summary, throughput=throughput)))


def test_csv_rows_go_by_throughput_as_perf_analyzers_do(tmp_path: Path) -> None:
    write_csv(tmp_path / "r.csv", [at("m", 1, 300.0), at("m", 2, 100.0), at("m", 4, 200.0)])
    rows = list(csv.DictReader((tmp_path / "r.csv").open(newline="")))
    assert [(r["Concurrency"], r["Inferences/Second"]) for r in rows] == [("2", "100.0"), ("4", "200.0"),
                                                                          ("1", "300.0")]


def test_several_models_in_one_csv_are_told_apart_by_a_leading_model_column(tmp_path: Path) -> None:
    # -m b -m a, one after another: b's levels, then a's; each block by throughput as perf_analyzer sorts.
    write_csv(tmp_path / "two.csv", [at("b", 1, 50.0), at("b", 2, 40.0), at("a", 1, 300.0), at("a", 2, 600.0)])
    header, *lines = list(csv.reader((tmp_path / "two.csv").open(newline="")))
    assert header == ["Model", *CSV_COLUMNS]
    assert [(line[0], line[1], line[2]) for line in lines] == [
        ("b", "2", "40.0"), ("b", "1", "50.0"), ("a", "1", "300.0"), ("a", "2", "600.0")]
    # Past the Model column, each row is what the model's own single-model CSV holds.
    write_csv(tmp_path / "a.csv", [at("a", 1, 300.0), at("a", 2, 600.0)])
    _, *alone = list(csv.reader((tmp_path / "a.csv").open(newline="")))
    assert [line[1:] for line in lines if line[0] == "a"] == alone


def test_one_model_keeps_perf_analyzers_columns_exactly(tmp_path: Path) -> None:
    write_csv(tmp_path / "one.csv", [at("a", 1, 300.0), at("a", 2, 600.0)])
    header = next(csv.reader((tmp_path / "one.csv").open(newline="")))
    assert header == CSV_COLUMNS and "Model" not in header


def test_a_partial_level_with_an_empty_window_reports_nulls_not_zeros(tmp_path: Path) -> None:
    empty = close(Tally(), 0, 10**9, batch=1)
    result = LevelResult(level=LoadLevel(concurrency=2), windows=(empty,), summary=merge([empty], 1), stable=False,
                         server=ServerBreakdown(), power=NONE, complete=False, stop_reason="interrupted (Ctrl-C)")
    assert result.failed
    doc = result_dict(result)
    assert doc["latency_us"] is None and doc["throughput"] == 0 and doc["requests"] == 0
    assert (doc["partial"], doc["stable"], doc["stop_reason"]) == (True, False, "interrupted (Ctrl-C)")
    write_csv(tmp_path / "e.csv", [ModelResult("m", result)])
    (row,) = csv.DictReader((tmp_path / "e.csv").open(newline=""))
    assert all(row[k] == "" for k in ("p50 latency", "p99 latency", "Avg latency", "Server Queue"))
    line = table([ModelResult("mlp", result)]).splitlines()[2].split()
    assert line[4:6] == ["–", "–"] and "partial" in line


@pytest.mark.parametrize(("power", "expected"), [(NVML, "150.0"), (NONE, "–")])
def test_table_shows_missing_figures_as_a_dash(power: PowerFigures, expected: str) -> None:
    text = table([ModelResult("mlp", level_result(LoadLevel(concurrency=2), power=power,
                                                   server=ServerBreakdown(requests=0)))])
    line = text.splitlines()[2].split()
    assert line[0] == "mlp" and line[3] == "200.0" and line[6] == expected
    assert line[-2] == "–"  # batch: nothing executed
    assert text.splitlines()[-1] == ("power source: nvml" if power is NVML else "power source: none (nvml: no GPU)")


def test_models_at_a_concurrency_and_at_a_rate_in_one_csv_keep_each_load_under_its_own_name(tmp_path: Path) -> None:
    # --model-concurrency a=4 --model-request-rate b=100: a's 4 is no request rate, b's 100 no concurrency.
    write_csv(tmp_path / "mixed.csv", [ModelResult("a", level_result(LoadLevel(concurrency=4))),
                                       ModelResult("b", level_result(LoadLevel(request_rate=100.0)))])
    rows = list(csv.DictReader((tmp_path / "mixed.csv").open(newline="")))
    assert [(r["Model"], r.get("Concurrency"), r.get("Request Rate")) for r in rows] == [
        ("a", "4", ""), ("b", "", "100.0")]
