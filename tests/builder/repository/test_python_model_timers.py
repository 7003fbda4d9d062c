"""The python-backend runner's phase timers (config parameter `runner_timers`), on the CPU: off, no clock is
read and no file written; on, the JSON it writes counts exactly the executes, requests and rows it served,
and each phase is a non-negative share of the execute it was measured in. The CUDA bucket's phase marks are
checked with the stand-in cuda-python runtime of test_python_model_inputs (no GPU here). A real Triton run
is the `server` test at the end."""

from __future__ import annotations

import json
import os
import time
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

from builder.repository import python_model
from builder.serving.triton_server import Ports, TritonServer, free_ports
from tests.builder.repository.test_python_model_inputs import _memmove_cuda
from tests.helpers.fake_pb_utils import FakeTensor as _Tensor
from tests.helpers.tiny_models import mlp_onnx

RUNNER: Any = python_model  # untyped: copied into model folders, where Triton imports it
DL_CPU = 1


def _model(tmp_path: Path, parameters: dict[str, str] | None = None, *, max_batch: int = 8) -> Any:
    (tmp_path / "1").mkdir(parents=True, exist_ok=True)
    mlp_onnx(tmp_path / "1" / "model.onnx")
    params = {"intra_op_threads": "1", **(parameters or {})}
    config = {"max_batch_size": max_batch, "input": [{"name": "x"}], "output": [{"name": "logits"}],
              "parameters": {k: {"string_value": v} for k, v in params.items()}}
    model = RUNNER.TritonPythonModel()
    model.initialize({"model_config": json.dumps(config), "model_repository": str(tmp_path), "model_version": "1",
                      "model_name": "m", "model_instance_name": "m_0_0"})
    return model


def _requests(sizes: list[int], seed: int = 0) -> list[dict[str, _Tensor]]:
    rng = np.random.default_rng(seed)
    return [{"x": _Tensor(rng.standard_normal((n, 4, 32), dtype=np.float32))} for n in sizes]


def _files(folder: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    (summary,) = [json.loads(p.read_text()) for p in folder.glob("*.json")]
    lines = (folder / summary["intervals_file"]).read_text().splitlines()
    return summary, [json.loads(line) for line in lines]


class _NoClock:
    """The runner's `time` module with its clocks refusing to be read."""

    def __getattr__(self, name: str) -> Any:
        if name in ("perf_counter_ns", "monotonic_ns", "perf_counter", "monotonic", "time", "time_ns"):
            raise AssertionError(f"time.{name} read with the timers off")
        return getattr(time, name)


def test_timers_off_read_no_clock_and_write_no_file(tmp_path: Path, pb_utils: types.SimpleNamespace,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model(tmp_path / "m")
    assert model.timer is None and model.runner.timer is None
    monkeypatch.setattr(RUNNER, "time", _NoClock())
    responses = model.execute(_requests([2, 1, 3]))
    assert [r.error for r in responses] == [None, None, None]
    model.finalize()
    assert sorted(p.name for p in (tmp_path / "m").rglob("*") if p.is_file()) == ["model.onnx"]


def test_timers_count_every_execute_request_and_row_and_phases_fit_inside_it(
        tmp_path: Path, pb_utils: types.SimpleNamespace) -> None:
    folder = tmp_path / "timers"
    model = _model(tmp_path / "m", {"runner_timers": str(folder), "runner_timers_period_s": "3600"})
    assert (folder / f"m_0_0.{os.getpid()}.json").is_file()  # written at load
    batches = [[1], [2, 3], [1, 1, 1, 1], [8], [4, 4, 1]]  # the last: 9 rows, more than max_batch 8
    outside_ns = 0
    for i, sizes in enumerate(batches):
        t0 = time.perf_counter_ns()
        responses = model.execute(_requests(sizes, seed=i))
        outside_ns += time.perf_counter_ns() - t0
        assert all(r.error is None for r in responses)
    model.finalize()
    summary, intervals = _files(folder)
    assert summary["final"] is True and summary["model"] == "m" and summary["instance"] == "m_0_0"
    assert summary["executes"] == len(batches)
    assert summary["requests"] == sum(len(b) for b in batches)
    assert summary["rows"] == sum(sum(b) for b in batches)
    execute = summary["execute"]
    assert execute["count"] == len(batches) and 0 < execute["sum_ns"] <= outside_ns
    phases = summary["phases"]
    assert set(phases) == set(RUNNER.PHASES)
    assert all(p["sum_ns"] >= 0 and p["weighted_sum_ns"] >= 0 for p in phases.values())
    assert sum(p["sum_ns"] for p in phases.values()) <= execute["sum_ns"]
    assert sum(p["weighted_sum_ns"] for p in phases.values()) <= execute["weighted_sum_ns"]
    for name in ("read_inputs", "gather", "run", "respond"):  # the CPU runner's phases, in every execute
        assert phases[name]["count"] == len(batches)
    for name in ("h2d", "d2d_wait", "d2h"):  # the CUDA bucket's only
        assert phases[name]["count"] == 0 and phases[name]["p50_us"] is None
    assert execute["p50_us"] <= execute["p99_us"] <= execute["max_us"]
    # One line per period with executes in it (here one, closed at finalize), its stamps in order.
    assert sum(line["executes"] for line in intervals) == len(batches)
    assert sum(line["requests"] for line in intervals) == summary["requests"]
    for line in intervals:
        assert line["first_ns"] <= line["last_ns"]
        assert sum(line["phases_ns"].values()) <= line["execute_ns"]


def test_timers_write_each_period_so_a_killed_server_leaves_figures(
        tmp_path: Path, pb_utils: types.SimpleNamespace) -> None:
    """A period shorter than any execute: every execute ends with a write; the files hold what was served
    so far, with no finalize (a server killed with SIGKILL never calls it)."""
    folder = tmp_path / "timers"
    model = _model(tmp_path / "m", {"runner_timers": str(folder), "runner_timers_period_s": "1e-9"})
    for n in range(1, 4):
        model.execute(_requests([1] * n, seed=n))
        summary, intervals = _files(folder)
        assert summary["final"] is False
        assert (summary["executes"], summary["requests"]) == (n, n * (n + 1) // 2)
        assert [line["requests"] for line in intervals] == list(range(1, n + 1))
        assert summary["timer_writes"]["count"] == n + 1  # the load's write, then one at each execute's end
    assert not list(folder.glob("*.tmp"))  # written by rename


def test_a_failed_batch_is_counted_and_timed(tmp_path: Path, pb_utils: types.SimpleNamespace,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "timers"
    model = _model(tmp_path / "m", {"runner_timers": str(folder)})

    def fails(feeds: Any) -> Any:
        raise MemoryError()

    monkeypatch.setattr(model.runner, "run_many", fails)
    responses = model.execute(_requests([1, 2]))
    assert all(r.error is not None for r in responses)
    model.finalize()
    summary, _ = _files(folder)
    assert (summary["executes"], summary["requests"], summary["rows"]) == (1, 2, 3)
    assert summary["phases"]["respond"]["count"] == 1 and summary["phases"]["run"]["count"] == 0


def test_batch_lines_give_each_executes_rows_and_times_within_the_cap(tmp_path: Path,
                                                                      pb_utils: types.SimpleNamespace) -> None:
    folder = tmp_path / "timers"
    model = _model(tmp_path / "m", {"runner_timers": str(folder), "runner_timers_period_s": "3600",
                                    "runner_timers_batches": "3"})
    batches = [[1], [2, 3], [1, 1, 1, 1], [8]]
    spans = []
    for i, sizes in enumerate(batches):
        t0 = time.monotonic_ns()
        model.execute(_requests(sizes, seed=i))
        spans.append((t0, time.monotonic_ns()))
    model.finalize()
    summary, _ = _files(folder)
    assert summary["batches_dropped"] == 1  # 3 kept per period, the 4th counted
    lines = [json.loads(line) for line in (folder / summary["batches_file"]).read_text().splitlines()]
    assert [(b["requests"], b["rows"]) for b in lines] == [(1, 1), (2, 5), (4, 4)]
    for line, (t0, t1) in zip(lines, spans, strict=False):
        assert t0 <= line["start_ns"] and line["start_ns"] + line["execute_ns"] <= t1  # the client's clock
        assert 0 < line["run_ns"] <= line["execute_ns"]


def test_batch_lines_are_flushed_each_period_and_their_run_times_are_the_run_phases(
        tmp_path: Path, pb_utils: types.SimpleNamespace) -> None:
    folder = tmp_path / "timers"
    model = _model(tmp_path / "m", {"runner_timers": str(folder), "runner_timers_period_s": "1e-9",
                                    "runner_timers_batches": " 2 "})
    sizes = [[1], [2, 3], [4], [8], [4]]
    for i, batch in enumerate(sizes):
        model.execute(_requests(batch, seed=i))
    model.finalize()
    summary, intervals = _files(folder)
    lines = [json.loads(line) for line in (folder / summary["batches_file"]).read_text().splitlines()]
    assert summary["batches_dropped"] == 0 and all(iv["batches_dropped"] == 0 for iv in intervals)
    assert [b["rows"] for b in lines] == [sum(b) for b in sizes]  # each period's lines, written once
    assert sum(b["run_ns"] for b in lines) == summary["phases"]["run"]["sum_ns"]
    assert sum(b["execute_ns"] for b in lines) == summary["execute"]["sum_ns"]


@pytest.mark.parametrize("value", ["0", ""])
def test_no_batch_lines_unless_asked(value: str, tmp_path: Path, pb_utils: types.SimpleNamespace) -> None:
    folder = tmp_path / "timers"
    model = _model(tmp_path / "m", {"runner_timers": str(folder), "runner_timers_batches": value})
    model.execute(_requests([1, 2]))
    model.finalize()
    summary, intervals = _files(folder)
    assert "batches_file" not in summary and "batches_dropped" not in intervals[0]
    assert not list(folder.glob("*.batches.jsonl"))


def test_a_timer_write_that_fails_stops_the_files_not_the_requests(tmp_path: Path, pb_utils: types.SimpleNamespace,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    folder = tmp_path / "timers"
    model = _model(tmp_path / "m", {"runner_timers": str(folder), "runner_timers_period_s": "1e-9",
                                    "runner_timers_batches": "10"})
    (summary_file,) = folder.glob("*.json")
    (folder / json.loads(summary_file.read_text())["intervals_file"]).mkdir()  # no period's line can be appended
    for i in range(3):
        responses = model.execute(_requests([1, 2], seed=i))
        assert [r.error for r in responses] == [None, None]
    model.finalize()
    assert model.timer.write_failed is not None
    assert sum("runner timers: writing to" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("value", ["x", "-1", "2.5", "²", "٣"])
def test_a_bad_batch_count_is_refused_at_load(value: str, tmp_path: Path, pb_utils: types.SimpleNamespace) -> None:
    with pytest.raises(ValueError, match="parameter runner_timers_batches"):
        _model(tmp_path / "m", {"runner_timers": str(tmp_path / "t"), "runner_timers_batches": value})


def test_a_bad_period_is_refused_at_load(tmp_path: Path, pb_utils: types.SimpleNamespace) -> None:
    with pytest.raises(ValueError, match="parameter runner_timers_period_s"):
        _model(tmp_path / "m", {"runner_timers": str(tmp_path / "t"), "runner_timers_period_s": "0"})


class _Marks:
    def __init__(self) -> None:
        self.phases: list[str] = []

    def mark(self, phase: str) -> None:
        assert phase in RUNNER.PHASES
        self.phases.append(phase)


class _Value:
    """An OrtValue as far as a bucket uses it."""

    def __init__(self, array: NDArray[Any]) -> None:
        self.array = array

    def data_ptr(self) -> int:
        return int(self.array.ctypes.data)

    def update_inplace(self, host: NDArray[Any]) -> None:
        self.array[...] = host

    def numpy(self) -> NDArray[Any]:
        return self.array.copy()


def _bucket(rows: int) -> Any:
    bucket = object.__new__(RUNNER._Bucket)
    bucket.device_id, bucket.output_names = 0, ["y"]
    bucket.inputs, bucket.host = {"x": _Value(np.zeros((rows, 3), np.float32))}, {"x": np.zeros((rows, 3), np.float32)}
    bucket.outputs = {"y": _Value(np.arange(rows * 2, dtype=np.float32).reshape(rows, 2))}
    bucket.session, bucket.binding = types.SimpleNamespace(run_with_iobinding=lambda binding: None), None
    return bucket


def test_the_cuda_bucket_marks_its_phases_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """Host inputs: gather, h2d, run, d2h; inputs already on the GPU: the device copies' issue (gather) and
    the wait for them (d2d_wait) instead of the host copy. Without a timer the same calls run unmarked."""
    monkeypatch.setattr(RUNNER.DeviceInput, "devices", (DL_CPU,))
    _memmove_cuda(monkeypatch)
    bucket = _bucket(4)
    parts = [np.ones((1, 3), np.float32), np.full((2, 3), 2, np.float32)]
    marks = _Marks()
    out = bucket.run_parts([{"x": p} for p in parts], 3, marks)
    assert marks.phases == ["gather", "h2d", "run", "d2h"] and out[0].shape == (3, 2)
    np.testing.assert_array_equal(bucket.inputs["x"].array[:3], np.concatenate(parts))
    marks = _Marks()
    bucket.run_parts([{"x": RUNNER.DeviceInput(p.__dlpack__())} for p in parts], 3, marks)
    assert marks.phases == ["gather", "d2d_wait", "run", "d2h"]
    assert len(bucket.run_parts([{"x": parts[0]}], 1)[0]) == 1  # timer None: no marks, same result


TIMED_CONFIG = """name: "timed"
backend: "python"
max_batch_size: 8
input {{ name: "x" data_type: TYPE_FP32 dims: [4, 32] }}
output {{ name: "logits" data_type: TYPE_FP32 dims: [16] }}
dynamic_batching {{ max_queue_delay_microseconds: 2000 }}
instance_group {{ kind: KIND_CPU count: {instances} }}
parameters {{ key: "intra_op_threads" value {{ string_value: "1" }} }}
parameters {{ key: "runner_timers" value {{ string_value: "{folder}" }} }}
parameters {{ key: "runner_timers_period_s" value {{ string_value: "3600" }} }}
"""


@pytest.mark.server
def test_a_served_model_writes_timers_that_match_tritons_own_counts(tmp_path: Path) -> None:
    """The runner in a real Triton (two instances, dynamic batching), 48 requests from 8 threads: after the
    server stops (finalize), the instances' files together count Triton's executions, requests and rows."""
    import tritonclient.grpc as tc

    folder, repository = tmp_path / "timers", tmp_path / "repository"
    (repository / "timed" / "1").mkdir(parents=True)
    mlp_onnx(repository / "timed" / "1" / "model.onnx")
    (repository / "timed" / "1" / "model.py").write_text(Path(RUNNER.__file__).read_text())
    (repository / "timed" / "config.pbtxt").write_text(TIMED_CONFIG.format(instances=2, folder=folder))
    server = TritonServer(repository, tmp_path / "state", Ports(*free_ports(3)))
    server.start(timeout=180)
    try:
        client = tc.InferenceServerClient(url=f"127.0.0.1:{server.ports.grpc}")
        rng = np.random.default_rng(0)
        sizes = [1 + i % 3 for i in range(48)]  # 1, 2 or 3 rows each

        def infer(rows: int) -> Any:
            item = tc.InferInput("x", [rows, 4, 32], "FP32")
            item.set_data_from_numpy(rng.standard_normal((rows, 4, 32), dtype=np.float32))
            return client.infer("timed", [item]).as_numpy("logits")

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(infer, sizes))
        assert [a.shape for a in answers] == [(n, 16) for n in sizes]
        (stats,) = client.get_inference_statistics("timed", as_json=True)["model_stats"]
        client.close()
    finally:
        server.stop()
    files = [json.loads(p.read_text()) for p in folder.glob("*.json")]
    assert len(files) == 2 and {f["instance"] for f in files} == {"timed_0_0", "timed_0_1"}
    assert all(f["final"] for f in files)  # finalize ran at the server's stop
    assert sum(f["executes"] for f in files) == int(stats["execution_count"])
    assert sum(f["requests"] for f in files) == len(sizes) == int(stats["inference_stats"]["success"]["count"])
    assert sum(f["rows"] for f in files) == sum(sizes) == int(stats["inference_count"])
    for f in files:
        phases = f["phases"].values()
        assert all(p["sum_ns"] >= 0 for p in phases)
        assert sum(p["sum_ns"] for p in phases) <= f["execute"]["sum_ns"]
        lines = [json.loads(line) for line in (folder / f["intervals_file"]).read_text().splitlines()]
        assert sum(line["executes"] for line in lines) == f["executes"]
