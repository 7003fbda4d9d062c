"""bench/gpu/bench_ort.py --trace-rate, its CPU-side parts: reading Triton's trace file, choosing each level's
traced requests, and the "where the tail comes from" table, on a trace recorded here (data/triton_trace_cpu: the
bundled Triton tracing 1 in 3 requests of the demo's FP16 EfficientNet-Lite0 on the CPU under perfclient at
concurrency 4 and 16; served.json says how)."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = Path(__file__).resolve().parent / "data" / "triton_trace_cpu"


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("trace") / "trace.json"
    path.write_bytes(gzip.decompress((SAMPLE / "trace.json.gz").read_bytes()))
    return path


def _sample() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((SAMPLE / "served.json").read_text())
    return doc


def _levels(bench_ort: ModuleType, trace_file: Path) -> list[dict[str, Any]]:
    records = bench_ort.read_trace([trace_file])
    rows: list[dict[str, Any]] = _sample()["served"]
    for r in rows:
        r["trace"] = bench_ort.trace_breakdown(records, r["model"], r["span_monotonic_ns"])
    return rows


def test_every_traced_request_is_one_record_whose_phases_add_up_to_its_time_in_the_server(
        bench_ort: ModuleType, trace_file: Path) -> None:
    raw = json.loads(trace_file.read_text())
    records = bench_ort.read_trace([trace_file])
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
    records = bench_ort.read_trace([trace_file])
    picked = []
    for r in rows:
        lo, hi = r["span_monotonic_ns"]
        mine = {x["id"] for x in records if lo <= x["ns"]["QUEUE_START"] <= hi}
        assert r["trace"]["requests"] == len(mine)
        # Triton traces 1 in `rate`: the level's own measured requests, give or take those in flight at its
        # windows' edges (counted by the client at their end, here at their start).
        assert abs(r["trace"]["requests"] * rate - r["requests"]) <= rate + r["concurrency"]
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
    # At concurrency 16 on two CPU cores a request waits behind the batches before it: its queue is several
    # times that at 4.
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
    records = bench_ort.read_trace([trace_file])
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
    assert f"--trace-config=triton,log-frequency={bench_ort.TRACE_FLUSH}" in args
    assert "--trace-config=level=TIMESTAMPS" in args
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu" / "bench_ort.py"), "--models", str(tmp_path),
                           "--out", str(tmp_path / "out"), "--trace-rate", "-1"], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert proc.returncode == 2
    assert "--trace-rate -1: expected a whole number 1..4294967295" in proc.stderr.splitlines()[-1]
    assert not (tmp_path / "out").exists()
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu" / "bench_ort.py"), "--models", str(tmp_path),
                           "--out", str(tmp_path / "out"), "--trace-rate", "23", "--skip", "served"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2 and "--trace-rate with --skip served" in proc.stderr.splitlines()[-1]
    assert not (tmp_path / "out").exists()


def test_the_figures_of_the_recorded_levels(bench_ort: ModuleType, trace_file: Path) -> None:
    low, high = (r["trace"] for r in _levels(bench_ort, trace_file))
    assert (low["requests"], low["incomplete"], low["disordered"]) == (143, 0, 0)
    assert (low["median_requests"]["n"], low["slowest"]["n"]) == (15, 2)
    assert low["us"]["total"]["p50"] == pytest.approx(26040.478)
    assert low["us"]["total"]["p99"] == pytest.approx(46958.498)
    assert low["median_requests"]["us"]["queue"] == pytest.approx(10826.7, abs=0.1)
    assert low["slowest"]["us"]["total"] == pytest.approx(47771, abs=1)
    assert (high["requests"], high["median_requests"]["n"], high["slowest"]["n"]) == (139, 15, 2)
    assert high["us"]["total"]["p99"] == pytest.approx(120199.944)


def test_the_table_cells_are_the_levels_figures(bench_ort: ModuleType, trace_file: Path) -> None:
    lines = bench_ort.trace_markdown(_levels(bench_ort, trace_file), 3)
    assert "1 in 3 requests" in lines[1]
    first, slowest = ([c.strip() for c in line.split("|")[1:-1]] for line in lines[5:7])
    assert first[:8] == ["efficientnet_lite0_fp16", "1", "4", "none", "143", "27.58 / 47.14", "26.04 / 46.96",
                         "median (15)"]
    assert first[8:] == ["30", "10827", "173", "14438", "296", "269", "26034"]
    assert slowest[7] == "slowest 1 % (2)" and slowest[-1] == "47771"


@pytest.mark.parametrize(("n", "slowest"), [(1, 1), (2, 1), (100, 2), (101, 2), (300, 4)])
def test_percentiles_follow_the_clients_rule_and_the_slowest_are_at_least_one(bench_ort: ModuleType, n: int,
                                                                              slowest: int) -> None:
    # n requests whose phases are all 1 µs except queue = i µs, so the totals are 5 + i.
    records = [{"id": i, "model": "m", "ns": {}} for i in range(n)]
    for i, r in enumerate(records):
        t = 1000 * 100 * i
        for k, (_, a, b) in enumerate(bench_ort.TRACE_PHASES):
            r["ns"].setdefault(a, t)
            t += 1000 * (i if k == 1 else 1)
            r["ns"][b] = t
    got = bench_ort.trace_breakdown(records, "m", [0, 10**12])
    totals = [5.0 + i for i in range(n)]
    assert got["us"]["total"]["p50"] == totals[int(0.5 * (n - 1) + 0.5)]
    assert got["us"]["total"]["p99"] == totals[int(0.99 * (n - 1) + 0.5)]
    assert got["slowest"]["n"] == slowest
    assert got["slowest"]["us"]["queue"] == pytest.approx(sum(range(n - slowest, n)) / slowest)


def test_stamps_out_of_order_are_counted_and_left_out(bench_ort: ModuleType, trace_file: Path) -> None:
    records = bench_ort.read_trace([trace_file])
    row = _sample()["served"][0]
    whole = bench_ort.trace_breakdown(records, row["model"], row["span_monotonic_ns"])
    inside = next(r for r in records if row["span_monotonic_ns"][0] <= r["ns"]["QUEUE_START"])
    # A Triton whose response stamp came before the backend's output stamp: output negative, send longer.
    inside["ns"]["INFER_RESPONSE_COMPLETE"] = inside["ns"]["COMPUTE_OUTPUT_START"] - 1000
    got = bench_ort.trace_breakdown(records, row["model"], row["span_monotonic_ns"])
    assert (got["requests"], got["disordered"]) == (whole["requests"] - 1, 1)


def test_numbered_trace_files_are_read_in_order_and_joined(bench_ort: ModuleType, trace_file: Path,
                                                           tmp_path: Path) -> None:
    entries = json.loads(trace_file.read_text())
    base = tmp_path / "trace.json"
    # As Triton writes with a log frequency: path.0, path.1, ... (one request's entries may span two files).
    chunks = [entries[i:i + 300] for i in range(0, len(entries), 300)]
    for i, chunk in enumerate(chunks):
        (tmp_path / f"trace.json.{i}").write_text(json.dumps(chunk))
    (tmp_path / "trace.json.gz").write_text("not Triton's")
    files = bench_ort.trace_files(base)
    assert [f.name for f in files] == [f"trace.json.{i}" for i in range(len(chunks))]  # .10 after .9, not .1
    assert len(chunks) > 10
    assert bench_ort.read_trace(files) == bench_ort.read_trace([trace_file])


def test_an_unreadable_trace_is_a_line_per_level_not_the_runs_end(bench_ort: ModuleType, trace_file: Path,
                                                                   tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    rows = _sample()["served"]
    cut = tmp_path / "cut" / "trace.json"
    cut.parent.mkdir()
    cut.write_text(trace_file.read_text()[:-5000])  # a server killed before it closed the array
    bench_ort.attach_traces(rows, cut, tmp_path / "kept.json.gz")
    assert all("error" in r["trace"] for r in rows)
    assert "trace_error" in capsys.readouterr().out
    assert sum("trace unreadable" in line for line in bench_ort.trace_markdown(rows, 3)) == len(rows)
    assert not (tmp_path / "kept.json.gz").exists()
    bench_ort.attach_traces(rows, tmp_path / "none" / "trace.json", None)
    assert all("no trace file" in r["trace"]["error"] for r in rows)
    # A readable one: each level's figures, and the stamps kept for a later look.
    bench_ort.attach_traces(rows, trace_file, tmp_path / "kept.json.gz")
    assert [r["trace"]["requests"] for r in rows] == [143, 139]
    kept = json.loads(gzip.decompress((tmp_path / "kept.json.gz").read_bytes()))
    assert len(kept) == len(bench_ort.read_trace([trace_file]))


def test_served_starts_triton_with_the_trace_options(bench_ort: ModuleType, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.helpers.tiny_models import mlp_onnx

    models = tmp_path / "models"
    for precision in bench_ort.PRECISIONS:
        mlp_onnx((models / f"efficientnet_lite0_{precision}" / "1").mkdir(parents=True) or
                 models / f"efficientnet_lite0_{precision}" / "1" / "model.onnx")
    seen: list[list[str]] = []

    class Started(Exception):
        pass

    class FakeServer:
        def __init__(self, *args: Any, extra_args: list[str], **kwargs: Any) -> None:
            seen.append(extra_args)

        def start(self, timeout: float) -> None:
            raise Started

    monkeypatch.setattr(bench_ort, "TritonServer", FakeServer)
    for rate in (0, 23):
        with pytest.raises(Started):
            bench_ort.served(models, interval_ms=100, delay_us=0, tmp=tmp_path / f"t{rate}", precisions=("fp16",),
                             trace_rate=rate)
    untraced, traced = seen
    assert not any(a.startswith("--trace-config") for a in untraced)
    assert bench_ort.trace_args(tmp_path / "t23" / "trace.json", 23) == [a for a in traced if "trace" in a]


def test_a_level_none_of_whose_requests_succeeded_is_a_row_saying_so(bench_ort: ModuleType,
                                                                     trace_file: Path) -> None:
    ok, failed = _levels(bench_ort, trace_file)
    failed |= {"latency_us": None, "errors": {"UNAVAILABLE": 812}, "trace": None}
    doc = {"gpu": "g", "driver": "d", "onnxruntime": "o", "in_process": {},
           "served": [ok | {"power": {}, "server": {}, "window_checks": [],
                            "cpu_cores_busy": {"client": 0, "tritonserver": 0, "python_stubs": 0}}, failed]}
    text = bench_ort.markdown(doc)
    assert "| efficientnet_lite0_fp16 | 1 | 16 | none | no request succeeded: {'UNAVAILABLE': 812} |" in text
    summary = [line for line in text.splitlines() if line.startswith("| efficientnet_lite0_fp16 | ")
               and "| none | 1 |" in line]
    assert len(summary) == 1 and "| 4 |" in summary[0]  # the summary has the answered level only
    assert "Where the tail comes from" in text and "| median (15) |" in text


def test_served_goes_on_past_a_level_none_of_whose_requests_succeeded(bench_ort: ModuleType, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """What ended a run on an H200 (its first level under MPS got no answer): the level's errors are printed and
    recorded, and the next level is measured."""
    import os
    import types

    from tests.helpers.tiny_models import mlp_onnx

    models = tmp_path / "models"
    (models / "efficientnet_lite0_fp16" / "1").mkdir(parents=True)
    mlp_onnx(models / "efficientnet_lite0_fp16" / "1" / "model.onnx")

    class FakeServer:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.process = types.SimpleNamespace(pid=os.getpid())

        def start(self, timeout: float) -> None:
            pass

        def log_tail(self, lines: int) -> str:
            return "E1130 stub exited"

        def stop(self) -> None:
            pass

    answers = iter([(32, None), (256, {"avg": 900.0, "p50": 800.0, "p99": 1500.0})])

    def fake_result(result: Any) -> dict[str, Any]:
        concurrency, latency = next(answers)
        return {"concurrency": concurrency, "throughput": 0.0 if latency is None else 1000.0, "latency_us": latency,
                "power": {}, "server": {}, "errors": {} if latency else {"UNAVAILABLE": 64}}

    monkeypatch.setattr(bench_ort, "TritonServer", FakeServer)
    monkeypatch.setattr(bench_ort, "run", lambda config: [types.SimpleNamespace(result=types.SimpleNamespace(
        windows=[]))])
    monkeypatch.setattr(bench_ort, "result_dict", fake_result)
    monkeypatch.setattr(bench_ort, "window_checks", lambda result: [])
    rows = bench_ort.served(models, interval_ms=100, delay_us=0, tmp=tmp_path / "t", precisions=("fp16",),
                            unbatched=False, compare_shm=False)
    measured = [r for r in rows if "model" in r]
    assert [(r["concurrency"], r["latency_us"]) for r in measured] == [
        (32, None), (256, {"avg": 900.0, "p50": 800.0, "p99": 1500.0})]
    assert '"errors": {"UNAVAILABLE": 64}' in capsys.readouterr().out
    assert rows[-1] == {"server_log_tail": "E1130 stub exited"}
