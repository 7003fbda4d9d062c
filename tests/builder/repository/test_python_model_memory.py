"""The python-backend runner and out-of-memory failures: they surface as what they are, never as a fallback
("CUDA graphs off") or an empty error. No GPU here: a stand-in bucket raises what ONNX Runtime's CUDA
provider raises when its arena cannot grow; the runner's own handling is what is tested."""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

from builder.repository import python_model
from tests.helpers.tiny_models import mlp_onnx

RUNNER: Any = python_model  # untyped: copied into model folders, where Triton imports it
# ONNX Runtime's words when the CUDA arena cannot grow (BFCArena), as its pybind layer raises them.
ORT_OOM = ("[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Exception during initialization: "
           "onnxruntime/core/framework/bfc_arena.cc:359 void* onnxruntime::BFCArena::AllocateRawInternal(size_t, "
           "bool, onnxruntime::Stream*) Failed to allocate memory for requested buffer of size 268435456")


class _Bucket:
    """A bucket as far as CudaBucketRunner uses it; `graph_error` is what its CUDA-graph session raises
    (without a graph it loads). `made` lists each session asked for: with a graph or not."""

    graph_error: BaseException | None = None
    made: ClassVar[list[bool]] = []

    def __init__(self, path: str, size: int, *, provider_options: dict[str, str], cuda_graph: bool,
                 device_id: int, pin: bool = True) -> None:
        self.made.append(cuda_graph)
        if cuda_graph and self.graph_error is not None:
            raise self.graph_error
        self.host = {"x": np.zeros((size, 4, 32), np.float32)}
        self.output_names = ["logits"]
        self.cuda_graph = cuda_graph

    def run(self, feed: Any, rows: int) -> list[Any]:
        return [np.zeros((rows, 10), np.float32)]


def _bucket_raising(monkeypatch: pytest.MonkeyPatch, error: BaseException) -> list[bool]:
    made: ClassVar[list[bool]] = []
    monkeypatch.setattr(RUNNER, "_Bucket", type("Bucket", (_Bucket,), {"graph_error": error, "made": made}))
    return made


@pytest.mark.parametrize("error", [ort_state.RuntimeException(ORT_OOM), MemoryError()])
def test_out_of_memory_while_capturing_a_cuda_graph_is_raised_not_taken_for_graphs_off(
        error: BaseException, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    made = _bucket_raising(monkeypatch, error)
    with pytest.raises(type(error)):
        RUNNER.CudaBucketRunner(str(mlp_onnx(tmp_path / "m.onnx")), max_batch=4, provider_options={})
    assert made == [True]  # no second session on a device already full
    assert "CUDA graphs off" not in caplog.text


def test_a_graph_refusal_that_is_not_out_of_memory_still_falls_back(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    made = _bucket_raising(monkeypatch, ort_state.Fail(
        "This session cannot use the graph capture feature as requested by the user as all compute graph nodes "
        "have not been partitioned to the CUDA EP."))
    runner = RUNNER.CudaBucketRunner(str(mlp_onnx(tmp_path / "m.onnx")), max_batch=4, provider_options={})
    assert runner.graph_fallback is not None and "graph capture" in runner.graph_fallback
    assert made == [True, False, False, False]  # buckets 1, 2, 4: the first tried with a graph


class _Error:
    def __init__(self, message: str) -> None:
        self.message = message


class _Response:
    def __init__(self, output_tensors: list[Any] | None = None, error: Any = None) -> None:
        self.error = error


class _Tensor:
    def __init__(self, array: Any) -> None:
        self.array = array

    def is_cpu(self) -> bool:
        return True

    def as_numpy(self) -> Any:
        return self.array


def test_out_of_memory_in_a_batch_is_answered_as_out_of_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A MemoryError's own message is empty: each request of the batch is told what happened."""
    logger = types.SimpleNamespace(log_info=lambda text: None, log_warn=lambda text: None)
    monkeypatch.setattr(RUNNER, "pb_utils", types.SimpleNamespace(
        InferenceResponse=_Response, TritonError=_Error, Tensor=None, Logger=logger,
        get_input_tensor_by_name=lambda request, name: request[name]))
    (tmp_path / "1").mkdir()
    mlp_onnx(tmp_path / "1" / "model.onnx")
    config = {"max_batch_size": 8, "input": [{"name": "x"}], "output": [{"name": "logits"}],
              "parameters": {"intra_op_threads": {"string_value": "1"}}}
    model = RUNNER.TritonPythonModel()
    model.initialize({"model_config": json.dumps(config), "model_repository": str(tmp_path), "model_version": "1",
                      "model_name": "m"})

    def out_of_memory(feeds: Any) -> Any:
        raise MemoryError()

    monkeypatch.setattr(model.runner, "run_many", out_of_memory)
    x = np.zeros((2, 4, 32), np.float32)
    responses = model.execute([{"x": _Tensor(x)}, {"x": _Tensor(x)}])
    assert [r.error.message for r in responses] == ["out of memory (MemoryError)"] * 2
