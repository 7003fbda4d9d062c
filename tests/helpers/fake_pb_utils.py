"""A stand-in for the few `triton_python_backend_utils` names the python-backend runner uses (Triton is not in
the test process): input tensors in host or (as DLPack) "GPU" memory, responses, errors, output tensors, a logger,
and a `pb_utils` fixture that installs them into a runner module (tests/builder/repository/conftest.py)."""

from __future__ import annotations

import types
from typing import Any

import pytest
from numpy.typing import NDArray


class FakeTensor:
    """What `pb_utils.get_input_tensor_by_name` returns: host memory, or (on_gpu) a tensor to_dlpack exports."""

    def __init__(self, array: NDArray[Any], *, on_gpu: bool = False) -> None:
        self.array, self.on_gpu = array, on_gpu

    def is_cpu(self) -> bool:
        return not self.on_gpu

    def as_numpy(self) -> NDArray[Any]:
        assert not self.on_gpu, "as_numpy on a GPU tensor"
        return self.array

    def to_dlpack(self) -> Any:
        return self.array.__dlpack__()


class _Response:
    def __init__(self, output_tensors: list[Any] | None = None, error: Any = None) -> None:
        self.outputs = {t.name: t.array for t in output_tensors or []}
        self.error = error


class _Error:
    def __init__(self, message: str) -> None:
        self.message = message


class _Out:
    def __init__(self, name: str, array: NDArray[Any]) -> None:
        self.name, self.array = name, array


class _Logger:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str]] = []

    def log_info(self, text: str) -> None:
        self.lines.append(("info", text))

    def log_warn(self, text: str) -> None:
        self.lines.append(("warn", text))


def install(monkeypatch: pytest.MonkeyPatch, runner: Any) -> types.SimpleNamespace:
    """The few pb_utils names the runner uses (Triton is not in this process)."""
    fake = types.SimpleNamespace(InferenceResponse=_Response, TritonError=_Error, Tensor=_Out, Logger=_Logger(),
                                 get_input_tensor_by_name=lambda request, name: request[name])
    monkeypatch.setattr(runner, "pb_utils", fake)
    return fake
