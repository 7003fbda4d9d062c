"""bench/gpu/bench_ort.py --runner-timers, its CPU-side parts: reading the runner's timer files, choosing the
timer periods inside a level's measured windows, and the "where a request's time goes" table, on a sample
recorded here (data/runner_timers_cpu: the bundled Triton, the python runner on the CPU with timers on,
perfclient at concurrency 4 and 16, two rounds each; served.json says how)."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from builder.repository import triton_config
from tests.helpers.tiny_models import mlp_onnx

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = Path(__file__).resolve().parent / "data" / "runner_timers_cpu"


def _served(bench_ort: ModuleType, folder: Path = SAMPLE / "timers") -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = json.loads((SAMPLE / "served.json").read_text())["served"]
    timers = bench_ort.read_runner_timers(folder)
    for r in rows:
        r["runner_timers"] = bench_ort.runner_breakdown(timers, r["model"], r["span_monotonic_ns"])
    return rows


def test_each_level_gets_the_runner_periods_inside_its_measured_windows(bench_ort: ModuleType) -> None:
    (timers,) = bench_ort.read_runner_timers(SAMPLE / "timers")
    assert bench_ort.read_runner_timers(SAMPLE) == []  # served.json is no timer file
    total = sum(iv["requests"] for iv in timers["intervals"])
    rows = _served(bench_ort)
    assert len(rows) == 4
    for r in rows:
        got = r["runner_timers"]
        lo, hi = r["span_monotonic_ns"]
        inside = [iv for iv in timers["intervals"] if lo <= iv["first_ns"] and iv["last_ns"] <= hi]
        assert got["periods"] == len(inside) > 0 and got["requests"] == sum(iv["requests"] for iv in inside)
        assert got["requests"] < total
        assert all(v >= 0 for v in got["phases_us"].values())
        assert sum(got["phases_us"].values()) <= got["execute_us"]
        # Triton's batches and the runner's over (nearly) the same windows: the same size within 10 %
        assert got["requests_per_batch"] == pytest.approx(r["server"]["avg_batch"], rel=0.1)
    assert bench_ort.runner_breakdown([timers], "mlp", [0, 1]) is None  # no period inside
    assert bench_ort.runner_breakdown([timers], "other", rows[0]["span_monotonic_ns"]) is None


def test_the_table_rows_add_up_to_tritons_compute_infer(bench_ort: ModuleType) -> None:
    levels = bench_ort.where_time_goes(_served(bench_ort))
    assert [(v["model"], v["concurrency"], v["rounds"]) for v in levels] == [("mlp", 4, 2), ("mlp", 16, 2)]
    for level in levels:
        cells = {r["row"].strip(): r for r in level["rows"]}
        infer = cells["Triton compute_infer"]["us_per_batch"]
        phases = [r["us_per_batch"] for r in level["rows"] if r["row"].startswith("  runner: ")
                  and "execute()" not in r["row"]]
        assert len(phases) == len(bench_ort.PHASES) and all(v >= 0 for v in phases)
        remainder = cells["remainder: compute_infer - runner phases"]["us_per_batch"]
        assert remainder == pytest.approx(infer - sum(phases))
        parts = [v["us_per_batch"] for k, v in cells.items() if k.startswith("of it ")]
        assert len(parts) == 3 and sum(parts) == pytest.approx(remainder)
        execute = cells["runner: execute() wall time"]["us_per_batch"]
        assert sum(phases) <= execute < infer  # execute() runs inside compute_infer
        for r in level["rows"]:
            assert r["us_per_request"] == pytest.approx(r["us_per_batch"] / level["requests_per_batch"])
    text = "\n".join(bench_ort.where_time_goes_markdown(levels))
    assert text.count("Where a request's time goes: mlp, concurrency") == 2
    assert "| Triton compute_infer |" in text and "outside execute()" in text


def test_a_cut_line_of_a_killed_stub_is_left_out(bench_ort: ModuleType, tmp_path: Path) -> None:
    shutil.copytree(SAMPLE / "timers", tmp_path / "t")
    (lines,) = (tmp_path / "t").glob("*.jsonl")
    whole = len(lines.read_text().splitlines())
    with lines.open("a") as handle:
        handle.write('{"first_ns": 1, "last_ns"')
    (timers,) = bench_ort.read_runner_timers(tmp_path / "t")
    assert len(timers["intervals"]) == whole


def test_levels_without_runner_figures_get_no_table(bench_ort: ModuleType) -> None:
    rows = _served(bench_ort)
    rows[0]["runner_timers"] = None
    levels = bench_ort.where_time_goes([rows[0], {"compare": "perfclient", "model": "mlp"}])
    assert levels == [] and bench_ort.where_time_goes_markdown(levels) == []


def test_runner_timers_reach_the_served_config(bench_ort: ModuleType, tmp_path: Path) -> None:
    onnx = mlp_onnx(tmp_path / "m.onnx")
    bench_ort.write_model(tmp_path / "repo", "with", onnx, batching=True, instances=1, delay_us=0,
                          timers=tmp_path / "timers")
    bench_ort.write_model(tmp_path / "repo", "without", onnx, batching=True, instances=1, delay_us=0)
    params = {name: {k: v.string_value for k, v in triton_config.parse(
        (tmp_path / "repo" / name / "config.pbtxt").read_text()).parameters.items()} for name in ("with", "without")}
    assert params["with"]["runner_timers"] == str(tmp_path / "timers")
    assert "runner_timers" not in params["without"]
    assert {k: v for k, v in params["with"].items() if k != "runner_timers"} == params["without"]


def test_batching_variants_reach_the_served_config_and_bad_ones_are_one_line(bench_ort: ModuleType,
                                                                              tmp_path: Path) -> None:
    import argparse

    onnx = mlp_onnx(tmp_path / "m.onnx")
    name, sizes, preferred = bench_ort.batching_variant("fine=fine/buckets")
    bench_ort.write_model(tmp_path / "repo", f"fp16_batched_{name}", onnx, batching=True, instances=1, delay_us=0,
                          batch_buckets=sizes, preferred=preferred)
    config = triton_config.parse((tmp_path / "repo" / "fp16_batched_fine" / "config.pbtxt").read_text())
    assert config.parameters["batch_buckets"].string_value == "fine"
    assert list(config.dynamic_batching.preferred_batch_size) == [2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    for bad, said in (("a=1,2/0,4", "preferred batch sizes '0,4'"), ("a=1,2/x", "preferred batch sizes 'x'"),
                      ("x2=fine", "other than nodelay, xN or dNus"),
                      ("d200us=fine", "other than nodelay, xN or dNus"),
                      ("a=1,65", "65 is outside 1..max_batch_size (64)")):
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(said)):
            bench_ort.batching_variant(bad)


@pytest.mark.parametrize(("args", "said"), [
    (["--delay-us", "0", "--delay-variant", "0"], "other than --delay-us (0); got [0]"),
    (["--delay-variant", "250", "--delay-variant", "250"], "once"),
    (["--delay-variant", "-5"], ">= 0"),
])
def test_a_delay_variant_like_the_main_delay_or_repeated_is_refused_in_one_line(args: list[str], said: str,
                                                                                tmp_path: Path) -> None:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu" / "bench_ort.py"), "--models", str(tmp_path),
                           "--out", str(tmp_path / "out"), *args], capture_output=True, text=True, timeout=60,
                          cwd=ROOT)
    assert proc.returncode == 2
    assert said in proc.stderr.splitlines()[-1]
    assert not (tmp_path / "out").exists()


def _batch(instance: str, start: int, end: int, rows: int, run: int) -> dict[str, Any]:
    return {"instance": instance, "start_ns": start, "execute_ns": end - start, "run_ns": run, "requests": rows,
            "rows": rows}


def test_batches_are_grouped_by_rows_and_by_the_other_instances_running_at_their_start(
        bench_ort: ModuleType) -> None:
    batches = {"m": [_batch("c", -50_000, 60_000, 2, 40_000),  # started before the span: counted as running
                     _batch("a", 0, 100_000, 1, 50_000), _batch("b", 50_000, 250_000, 4, 150_000),
                     _batch("a", 100_000, 300_000, 8, 180_000), _batch("b", 250_000, 260_000, 1, 8_000),
                     _batch("c", 250_000, 270_000, 70, 10_000),  # starts with b's second: each counts the other
                     _batch("a", 400_000, 410_000, 3, 0),  # its inputs failed: counted apart
                     _batch("a", 900_000, 2_000_000, 1, 9_000)],  # ends outside the span: not grouped
               "other": [_batch("d", 0, 10, 1, 5)]}
    got = bench_ort.batch_breakdown(batches, "m", [0, 1_000_000], dropped=0)
    assert (got["batches"], got["failed"], got["dropped"]) == (5, 1, 0)
    assert [(g["rows"], g["n"], g["run_us_p50"]) for g in got["by_rows"]] == [
        ("1", 2, 50.0), ("3-4", 1, 150.0), ("5-8", 1, 180.0), ("65+", 1, 10.0)]
    # a@0 beside c's first; b@50 beside a's first and c's first; a@100 beside b (a's first ended at 100);
    # b@250 beside a's second and c@250; c@250 beside a's second and b@250.
    assert [(g["rows"], g["others_running"], g["n"]) for g in got["by_rows_and_running"]] == [
        ("1", 1, 1), ("1", 2, 1), ("3-4", 2, 1), ("5-8", 1, 1), ("65+", 2, 1)]
    assert bench_ort.batch_breakdown(batches, "m", [500_000, 600_000]) is None
    assert bench_ort.batch_breakdown({"m": [_batch("a", 0, 0, 1, 0), _batch("a", 5, 5, 1, 1)]}, "m",
                                     [0, 10])["by_rows_and_running"][0]["others_running"] == 0  # zero-length
    row = {"model": "m", "concurrency": 32, "round": 1, "runner_batches": got | {"dropped": 7}}
    lines = bench_ort.batch_markdown([row])
    assert "1 failed, left out); 7 batch lines not written" in lines[1]
    table = [line for line in lines if line.startswith("| ")][1:]
    assert table[0] == "| 1 | any | 2 | 50 / 50 | 100 |" and table[-1] == "| 65+ | 2 | 1 | 10 / 10 | 20 |"


def test_dropped_lines_are_counted_in_the_levels_periods(bench_ort: ModuleType) -> None:
    timers = [{"model": "m", "intervals": [{"first_ns": 0, "last_ns": 10, "batches_dropped": 3},
                                           {"first_ns": 20, "last_ns": 30, "batches_dropped": 4},
                                           {"first_ns": 50, "last_ns": 60}]},
              {"model": "n", "intervals": [{"first_ns": 0, "last_ns": 10, "batches_dropped": 100}]}]
    assert bench_ort.dropped_in(timers, "m", [0, 35]) == 7


def test_runner_batches_reach_the_config_and_need_the_timers(bench_ort: ModuleType, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess
    import sys

    monkeypatch.setattr(bench_ort, "RUNNER_BATCHES", 500)
    bench_ort.write_model(tmp_path / "repo", "m", mlp_onnx(tmp_path / "m.onnx"), batching=True, instances=1,
                          delay_us=0, timers=tmp_path / "t")
    params = triton_config.parse((tmp_path / "repo" / "m" / "config.pbtxt").read_text()).parameters
    assert params["runner_timers_batches"].string_value == "500"
    assert params["runner_timers_period_s"].string_value == "0.25"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu" / "bench_ort.py"), "--models", str(tmp_path),
                           "--out", str(tmp_path / "out"), "--runner-batches", "100"], capture_output=True,
                          text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2 and "with --runner-timers" in proc.stderr.splitlines()[-1]


def test_the_runners_batch_lines_are_read_per_model_with_their_instance(bench_ort: ModuleType,
                                                                        tmp_path: Path) -> None:
    for instance in ("m_0", "m_1"):
        timer = bench_ort.RUNNER.PhaseTimer(str(tmp_path), model="m", instance=instance, period_s=3600, batches=10)
        for rows in (1, 3):
            timer.start()
            timer.mark("run")
            timer.end(requests=rows, rows=rows)
        timer.write(final=True)
    with (tmp_path / f"m_1.{os.getpid()}.batches.jsonl").open("a") as cut:  # a stub killed mid-line
        cut.write('{"start_ns": 1, "cut')
    timers = bench_ort.read_runner_timers(tmp_path)
    got = bench_ort.read_runner_batches(tmp_path, timers)
    assert sorted((b["instance"], b["rows"]) for b in got["m"]) == [("m_0", 1), ("m_0", 3), ("m_1", 1), ("m_1", 3)]
