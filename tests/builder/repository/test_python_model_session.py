"""The runner's CUDA sessions inside Triton: made with ONNX Runtime's process-wide warnings off (1.31 prints
one plugin-EP line per session, so per bucket and instance in Triton's log), the logger back at its default
afterwards; where the CUDA provider does not start, the bucket runner refuses to load with a line naming the
file (its device tensors need the provider), after it has checked the shapes (a model whose shapes vary gets
one plain session), and the plain session runs on the CPU with a warning."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

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
    runner = RUNNER.CudaPlainRunner(str(varying), provider_options={})
    assert runner.session.get_providers() == ["CPUExecutionProvider"]
    assert f"{varying}: ONNX Runtime did not start its CUDA provider" in caplog.text
    assert "this model runs on the CPU" in caplog.text
