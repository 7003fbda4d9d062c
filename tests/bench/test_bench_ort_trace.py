"""bench/gpu/bench_ort.py --trace-rate, its CPU-side parts: reading Triton's trace file, choosing each level's
traced requests, and the "where the tail comes from" table, on a trace recorded here (data/triton_trace_cpu: the
bundled Triton tracing 1 in 3 requests of the demo's FP16 EfficientNet-Lite0 on the CPU under perfclient at
concurrency 4 and 16; served.json says how)."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.helpers.scripts import loaded_script

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = Path(__file__).resolve().parent / "data" / "triton_trace_cpu"


@pytest.fixture(scope="module")
def bench_ort() -> Iterator[ModuleType]:
    with loaded_script("bench_ort", ROOT / "bench" / "gpu" / "bench_ort.py") as module:
        yield module


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("trace") / "trace.json"
    path.write_bytes(gzip.decompress((SAMPLE / "trace.json.gz").read_bytes()))
    return path


def _sample() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((SAMPLE / "served.json").read_text())
    return doc


def _levels(bench_ort: ModuleType, trace_file: Path) -> list[dict[str, Any]]:
    records = bench_ort.read_trace(trace_file)
    rows: list[dict[str, Any]] = _sample()["served"]
    for r in rows:
        r["trace"] = bench_ort.trace_breakdown(records, r["model"], r["span_monotonic_ns"])
    return rows


def test_every_traced_request_is_one_record_whose_phases_add_up_to_its_time_in_the_server(
        bench_ort: ModuleType, trace_file: Path) -> None:
    raw = json.loads(trace_file.read_text())
    records = bench_ort.read_trace(trace_file)
    assert len(records) == len({e["id"] for e in raw})
    assert all(r["model"] == "efficientnet_lite0_fp16" for r in records)
    complete = [(r, p) for r in records if (p := bench_ort.request_phases(r)) is not None]
    assert len(complete) == len(records)  # the server stopped with nothing in flight
    for r, phases in complete:
        # The stamps come in the order the phases assume, on a real Triton: no phase is negative ...
        assert all(phases[name] >= 0 for name, _, _ in bench_ort.TRACE_PHASES), (r["id"], phases)
        # ... and they tile the request's time from its read to its response written.
        whole = (r["ns"]["GRPC_SEND_END"] - r["ns"]["GRPC_WAITREAD_END"]) / 1e3
        assert phases["total"] == pytest.approx(whole, abs=1e-6)


def test_each_level_gets_the_traced_requests_of_its_measured_windows_only(bench_ort: ModuleType,
                                                                          trace_file: Path) -> None:
    rows = _levels(bench_ort, trace_file)
    rate = _sample()["rate"]
    records = bench_ort.read_trace(trace_file)
    picked = []
    for r in rows:
        lo, hi = r["span_monotonic_ns"]
        mine = {x["id"] for x in records if lo <= x["ns"]["QUEUE_START"] <= hi}
        assert r["trace"]["requests"] == len(mine)
        # Triton traces 1 in `rate`: the level's own measured requests, give or take those in flight at its
        # windows' edges (counted by the client at their end, here at their start).
        assert abs(r["trace"]["requests"] * rate - r["requests"]) <= rate * (r["concurrency"] + 2)
        picked.append(mine)
    assert not picked[0] & picked[1]
    assert len(picked[0] | picked[1]) < len(records)  # the warm-up requests are in the file but in no level


def test_the_server_time_lies_inside_the_clients_and_the_slowest_requests_are_the_slowest(
        bench_ort: ModuleType, trace_file: Path) -> None:
    for r in _levels(bench_ort, trace_file):
        t = r["trace"]
        assert 0 < t["us"]["total"]["p50"] <= r["latency_us"]["p50"]
        assert t["us"]["total"]["p50"] <= t["us"]["total"]["p99"] <= r["latency_us"]["max"]
        assert t["slowest"]["n"] >= 1 and t["median_requests"]["n"] >= 1
        assert t["slowest"]["us"]["total"] >= t["us"]["total"]["p99"] > t["median_requests"]["us"]["total"]
        for part in (t["median_requests"], t["slowest"]):
            names = [name for name, _, _ in bench_ort.TRACE_PHASES]
            assert sum(part["us"][n] for n in names) == pytest.approx(part["us"]["total"])
    # At concurrency 16 on two CPU cores a request waits for the batches before it: the queue is its largest
    # phase, at 4 it is not yet (the runner's infer is).
    low, high = (r["trace"]["median_requests"]["us"] for r in _levels(bench_ort, trace_file))
    assert high["queue"] > 3 * low["queue"]


def test_the_table_has_a_median_and_a_slowest_row_per_traced_level_and_untraced_runs_get_none(
        bench_ort: ModuleType, trace_file: Path) -> None:
    rows = _levels(bench_ort, trace_file)
    lines = bench_ort.trace_markdown([*rows, {"compare": "perfclient", "concurrency": 32, "throughput": 1.0}])
    table = [line for line in lines if line.startswith("| ") and "---" not in line][1:]
    assert len(table) == 2 * len(rows)
    header = next(line for line in lines if line.startswith("| model"))
    assert all(line.count("|") == header.count("|") for line in table)
    assert "slowest 1 %" in table[1] and table[1].split("|")[1].strip() == ""  # the level named once
    assert bench_ort.trace_markdown([{**r, "trace": None} for r in rows]) == []


def test_a_request_cut_short_or_outside_the_model_is_left_out(bench_ort: ModuleType, trace_file: Path) -> None:
    records = bench_ort.read_trace(trace_file)
    row = _sample()["served"][0]
    whole = bench_ort.trace_breakdown(records, row["model"], row["span_monotonic_ns"])
    inside = next(r for r in records if row["span_monotonic_ns"][0] <= r["ns"]["QUEUE_START"])
    del inside["ns"]["GRPC_SEND_END"]  # in flight when the server stopped
    other = dict(next(r for r in records if r is not inside and
                      row["span_monotonic_ns"][0] <= r["ns"]["QUEUE_START"]), model="another_model")
    records = [r for r in records if r["id"] != other["id"]] + [other]
    cut = bench_ort.trace_breakdown(records, row["model"], row["span_monotonic_ns"])
    assert cut["incomplete"] == 1
    assert cut["requests"] == whole["requests"] - 2
    assert bench_ort.trace_breakdown(records, row["model"], [0, 1]) is None


def test_the_trace_options_reach_triton_and_a_bad_rate_is_one_line(bench_ort: ModuleType, tmp_path: Path) -> None:
    args = bench_ort.trace_args(tmp_path / "t.json", 20)
    assert f"--trace-config=triton,file={tmp_path / 't.json'}" in args and "--trace-config=rate=20" in args
    assert "--trace-config=level=TIMESTAMPS" in args
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu" / "bench_ort.py"), "--models", str(tmp_path),
                           "--out", str(tmp_path / "out"), "--trace-rate", "-1"], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert proc.returncode == 2
    assert "--trace-rate -1: expected a whole number >= 1" in proc.stderr.splitlines()[-1]
    assert not (tmp_path / "out").exists()
