"""The runner's CUDA sessions inside Triton: made with ONNX Runtime's process-wide warnings off (1.31 prints
one plugin-EP line per session, so per bucket and instance in Triton's log), the logger back at its default
afterwards, and a provider that does not start is an error naming the file, not a silent CPU run."""

from __future__ import annotations

from typing import Any

import pytest

from builder.repository import python_model

RUNNER: Any = python_model


def test_runner_cuda_session_quiets_onnx_runtime_and_refuses_a_cpu_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    levels: list[int] = []
    made: list[tuple[int, Any]] = []
    started: list[list[str]] = [["CUDAExecutionProvider", "CPUExecutionProvider"]]

    class Session:
        def __init__(self, path: str, *, sess_options: Any, providers: list[Any]) -> None:
            made.append((levels[-1], providers[0]))

        def get_providers(self) -> list[str]:
            return started[0]

    monkeypatch.setattr(RUNNER.ort, "InferenceSession", Session)
    monkeypatch.setattr(RUNNER.ort, "set_default_logger_severity", levels.append)
    options = {"device_id": "0"}
    RUNNER._cuda_session("/m/1/model.onnx", object(), options)
    assert made == [(3, ("CUDAExecutionProvider", options))] and levels == [3, 2]
    started[0] = ["CPUExecutionProvider"]
    with pytest.raises(RuntimeError, match=r"/m/1/model.onnx: ONNX Runtime did not start its CUDA provider"):
        RUNNER._cuda_session("/m/1/model.onnx", object(), options)
    assert [level for level, _ in made] == [3, 3, 2] and levels[-1] == 2  # again with the warnings that say why


def test_runner_restores_the_logger_when_the_session_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    levels: list[int] = []

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("bad model")

    monkeypatch.setattr(RUNNER.ort, "InferenceSession", broken)
    monkeypatch.setattr(RUNNER.ort, "set_default_logger_severity", levels.append)
    with pytest.raises(RuntimeError, match="bad model"):
        RUNNER._cuda_session("/m/1/model.onnx", object(), {})
    assert levels == [3, 2]
