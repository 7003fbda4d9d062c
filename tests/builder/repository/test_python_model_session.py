"""The runner's CUDA sessions inside Triton: made with ONNX Runtime's process-wide warnings off (1.31 prints
one plugin-EP line per session, so per bucket and instance in Triton's log), the logger back at its default
afterwards; where the CUDA provider does not start, the bucket runner refuses to load with a line naming the
file (its device tensors need the provider), after it has checked the shapes (a model whose shapes vary gets
one plain session), and the plain session runs on the CPU with a warning."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import onnx
import pytest
from onnx import TensorProto, helper

from builder.repository import python_model
from tests.helpers.tiny_models import mlp_onnx, sequence_onnx

RUNNER: Any = python_model


class FakeSessions:
    """Stands in for ort.InferenceSession: records the logger level each session was made at."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, providers: list[str]) -> None:
        self.levels: list[int] = []
        self.made: list[int] = []
        fake = self

        class Session:
            def __init__(self, path: str, *, sess_options: Any, providers: list[Any]) -> None:
                fake.made.append(fake.levels[-1])

            def get_providers(self) -> list[str]:
                return fake.providers

        self.providers = providers
        monkeypatch.setattr(RUNNER.ort, "InferenceSession", Session)
        monkeypatch.setattr(RUNNER.ort, "set_default_logger_severity", self.levels.append)


def test_sessions_are_made_quiet_and_a_failed_provider_again_with_its_warnings(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeSessions(monkeypatch, ["CUDAExecutionProvider", "CPUExecutionProvider"])
    session = RUNNER._cuda_session("/m/1/model.onnx", object(), {"device_id": "0"})
    assert fake.made == [3] and fake.levels == [3, 2] and RUNNER._no_cuda("/m/1/model.onnx", session) is None
    fake.providers = ["CPUExecutionProvider"]
    session = RUNNER._cuda_session("/m/1/model.onnx", object(), {})
    assert fake.made == [3, 3, 2] and fake.levels[-1] == 2  # again, with the warnings that say why
    assert RUNNER._no_cuda("/m/1/model.onnx", session).startswith(
        "/m/1/model.onnx: ONNX Runtime did not start its CUDA provider")


def test_the_logger_is_restored_when_the_session_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    levels: list[int] = []

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("bad model")

    monkeypatch.setattr(RUNNER.ort, "InferenceSession", broken)
    monkeypatch.setattr(RUNNER.ort, "set_default_logger_severity", levels.append)
    with pytest.raises(RuntimeError, match="bad model"):
        RUNNER._cuda_session("/m/1/model.onnx", object(), {})
    assert levels == [3, 2]


def test_without_the_provider_the_bucket_refuses_after_the_shapes_and_the_plain_runner_warns(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    fixed, varying = mlp_onnx(tmp_path / "fixed.onnx"), sequence_onnx(tmp_path / "varying.onnx")

    def cpu_only(path: str, *, sess_options: Any, providers: list[Any]) -> Any:
        return RUNNER.ort.capi.onnxruntime_inference_collection.InferenceSession(
            path, sess_options=sess_options, providers=["CPUExecutionProvider"])

    monkeypatch.setattr(RUNNER.ort, "InferenceSession", cpu_only)
    with pytest.raises(RuntimeError, match=f"^{fixed}: ONNX Runtime did not start its CUDA provider"):
        RUNNER._Bucket(str(fixed), 4, provider_options={}, cuda_graph=False, device_id=0, pin=False)
    with pytest.raises(RUNNER.DynamicDims):  # the shapes first: such a model falls back to one plain session
        RUNNER._Bucket(str(varying), 4, provider_options={}, cuda_graph=False, device_id=0, pin=False)
    # Fixed inputs, an output whose width varies (Compress): also one plain session, not a failed load.
    nodes = [helper.make_node("ReduceMax", ["x"], ["m"], axes=[0], keepdims=0),
             helper.make_node("Greater", ["m", "zero"], ["keep"]),
             helper.make_node("Compress", ["x", "keep"], ["y"], axis=1)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "k"])],
                              initializer=[helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, tmp_path / "outputs_vary.onnx")
    with pytest.raises(RUNNER.DynamicDims, match="output y"):
        RUNNER._Bucket(str(tmp_path / "outputs_vary.onnx"), 4, provider_options={}, cuda_graph=False, device_id=0,
                       pin=False)
    # With CUDA graphs on (the default) the missing provider is not taken for a graph refusal: no retry.
    with pytest.raises(RUNNER.NoCudaProvider):
        RUNNER.CudaBucketRunner(str(fixed), max_batch=4, provider_options={}, cuda_graphs=True, sizes=[4], pin=False)
    assert "CUDA graphs off" not in caplog.text
    runner = RUNNER.CudaPlainRunner(str(varying), provider_options={})
    assert runner.session.get_providers() == ["CPUExecutionProvider"]
    assert f"{varying}: ONNX Runtime did not start its CUDA provider" in caplog.text
    assert "this model runs on the CPU" in caplog.text
    assert runner.describe()["provider"] == "cpu (the CUDA provider did not start)"
