"""The python-backend runner's request inputs, on the CPU: how `execute` takes inputs the backend hands
over in GPU memory (DLPack capsules), what it answers when it cannot read one, and the device gather's
pointer arithmetic. No GPU here: host capsules stand in for device ones (`DeviceInput.devices` widened
to the CPU), and a stand-in for cuda-python's runtime copies with memmove, so the addresses, offsets
and error paths are the runner's own."""

from __future__ import annotations

import ctypes
import json
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from numpy.typing import NDArray

from builder.repository import python_model
from tests.helpers.fake_pb_utils import FakeTensor as _Tensor
from tests.helpers.scripts import install_cuda_runtime
from tests.helpers.tiny_models import mlp_onnx

RUNNER: Any = python_model  # untyped: copied into model folders, where Triton imports it
DL_CPU = 1


def _no_cuda_python(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("cuda", "cuda.bindings", "cuda.bindings.runtime", "cuda.cudart"):
        monkeypatch.setitem(sys.modules, name, None)  # None in sys.modules: the import raises ImportError


def _memmove_cuda(monkeypatch: pytest.MonkeyPatch, calls: list[tuple[Any, ...]] | None = None,
                  ) -> list[tuple[int, int, int]]:
    """cuda-python's runtime as far as the runner uses it; every copy is a memmove, recorded (and with
    `calls`, every call in order)."""
    copies: list[tuple[int, int, int]] = []
    log = calls if calls is not None else []

    def memcpy_async(dst: int, src: int, nbytes: int, kind: int, stream: int) -> tuple[int]:
        copies.append((dst, src, nbytes))
        log.append(("cudaMemcpyAsync", nbytes))
        ctypes.memmove(dst, src, nbytes)
        return (0,)

    def recorded(name: str) -> Any:
        def call(*args: Any) -> tuple[int]:
            log.append((name, *args))
            return (0,)

        return call

    def host_register(ptr: int, size: int, flags: int) -> tuple[int]:
        log.append(("cudaHostRegister", size))
        return (0,)

    runtime = types.ModuleType("cuda.bindings.runtime")
    runtime.cudaError_t = types.SimpleNamespace(cudaSuccess=0)  # type: ignore[attr-defined]
    runtime.cudaMemcpyKind = types.SimpleNamespace(cudaMemcpyDefault=4)  # type: ignore[attr-defined]
    runtime.cudaMemcpyAsync = memcpy_async  # type: ignore[attr-defined]
    runtime.cudaStreamSynchronize = recorded("cudaStreamSynchronize")  # type: ignore[attr-defined]
    runtime.cudaSetDevice = recorded("cudaSetDevice")  # type: ignore[attr-defined]
    runtime.cudaHostRegisterDefault = 0  # type: ignore[attr-defined]
    runtime.cudaHostRegister = host_register  # type: ignore[attr-defined]
    runtime.cudaHostUnregister = recorded("cudaHostUnregister")  # type: ignore[attr-defined]
    install_cuda_runtime(monkeypatch, runtime)
    return copies


def _model(tmp_path: Path, parameters: dict[str, str] | None = None) -> Any:
    (tmp_path / "1").mkdir(exist_ok=True)
    mlp_onnx(tmp_path / "1" / "model.onnx")
    params = {"intra_op_threads": "1", **(parameters or {})}
    config = {"max_batch_size": 8, "input": [{"name": "x"}], "output": [{"name": "logits"}],
              "parameters": {k: {"string_value": v} for k, v in params.items()}}
    model = RUNNER.TritonPythonModel()
    model.initialize({"model_config": json.dumps(config), "model_repository": str(tmp_path), "model_version": "1",
                      "model_name": "m"})
    return model


def _want(tmp_path: Path, x: NDArray[Any]) -> NDArray[Any]:
    session = ort.InferenceSession(str(tmp_path / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    return np.asarray(session.run(["logits"], {"x": x})[0])


def test_an_input_the_runner_cannot_read_fails_its_own_request_not_the_batch(
        tmp_path: Path, pb_utils: types.SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tensor the backend exports from memory that is not CUDA's is refused for that request only; its
    batch-mates are answered (an exception out of execute fails every request of the batch)."""
    _memmove_cuda(monkeypatch)
    model = _model(tmp_path)
    rng = np.random.default_rng(0)
    good, bad = rng.standard_normal((2, 4, 32), dtype=np.float32), rng.standard_normal((1, 4, 32), dtype=np.float32)
    responses = model.execute([{"x": _Tensor(good)}, {"x": _Tensor(bad, on_gpu=True)}])
    assert responses[0].error is None
    np.testing.assert_allclose(responses[0].outputs["logits"], _want(tmp_path, good), rtol=1e-5, atol=1e-6)
    assert responses[1].error is not None and not responses[1].outputs
    assert responses[1].error.message == "input x: DLPack device type 1 is not a CUDA device"


def test_gpu_inputs_without_cuda_python_are_one_clear_line_per_request(
        tmp_path: Path, pb_utils: types.SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    """A client sends CUDA shared memory to a server whose Python lacks cuda-python: each such request is
    answered with what is missing (said once at load too), host requests still run."""
    monkeypatch.setattr(RUNNER.DeviceInput, "devices", (DL_CPU,))
    _no_cuda_python(monkeypatch)
    model = _model(tmp_path, {"FORCE_CPU_ONLY_INPUT_TENSORS": "no"})
    warnings = [text for level, text in pb_utils.Logger.lines if level == "warn"]
    assert len(warnings) == 1 and "needs cuda-python in the server's Python (pip install cuda-python)" in warnings[0]
    x = np.random.default_rng(1).standard_normal((3, 4, 32), dtype=np.float32)
    responses = model.execute([{"x": _Tensor(x[:1], on_gpu=True)}, {"x": _Tensor(x[1:])}])
    message = responses[0].error.message
    assert message.startswith("input x: ") and "\n" not in message
    assert "needs cuda-python in the server's Python (pip install cuda-python)" in message
    assert responses[1].error is None  # its batch-mate in host memory is answered
    np.testing.assert_allclose(responses[1].outputs["logits"], _want(tmp_path, x[1:]), rtol=1e-5, atol=1e-6)


def test_gpu_inputs_reach_a_host_runner_through_their_address(
        tmp_path: Path, pb_utils: types.SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    """Device inputs read through the capsule's address (an offset view: its own address) give the same
    answers as the same rows sent in host memory."""
    monkeypatch.setattr(RUNNER.DeviceInput, "devices", (DL_CPU,))
    copies = _memmove_cuda(monkeypatch)
    model = _model(tmp_path, {"FORCE_CPU_ONLY_INPUT_TENSORS": "no"})
    assert not [text for level, text in pb_utils.Logger.lines if level == "warn"]
    big = np.random.default_rng(2).standard_normal((6, 4, 32), dtype=np.float32)
    first, second = big[1:3], big[3:6]  # views into one buffer, at offsets 1 and 3 rows
    responses = model.execute([{"x": _Tensor(first, on_gpu=True)}, {"x": _Tensor(second, on_gpu=True)}])
    assert [r.error for r in responses] == [None, None]
    want = _want(tmp_path, big[1:6])
    np.testing.assert_allclose(np.concatenate([r.outputs["logits"] for r in responses]), want, rtol=1e-5, atol=1e-6)
    want_copies = [(first.ctypes.data, first.nbytes), (second.ctypes.data, second.nbytes)]
    assert [(src, n) for _, src, n in copies] == want_copies


class _Bound:
    """An OrtValue bound as a bucket's input: only its address is used by the gather."""

    def __init__(self, array: NDArray[Any]) -> None:
        self.array = array

    def data_ptr(self) -> int:
        return int(self.array.ctypes.data)


def _bucket(rows: int, shape: tuple[int, ...], dtype: Any = np.float32) -> tuple[Any, NDArray[Any]]:
    bucket = object.__new__(RUNNER._Bucket)
    bound = np.full((rows, *shape), -1, dtype=dtype)
    bucket.device_id, bucket.inputs, bucket.host = 0, {"x": _Bound(bound)}, {"x": np.zeros((rows, *shape), dtype)}
    return bucket, bound


def test_the_device_gather_puts_each_request_at_its_row_offset(monkeypatch: pytest.MonkeyPatch) -> None:
    """Device and host parts mixed: each lands at its row offset of the bound input, in request order."""
    monkeypatch.setattr(RUNNER.DeviceInput, "devices", (DL_CPU,))
    _memmove_cuda(monkeypatch)
    bucket, bound = _bucket(8, (3, 5))
    rng = np.random.default_rng(3)
    parts = [rng.standard_normal((n, 3, 5), dtype=np.float32) for n in (2, 1, 3)]
    feeds = [RUNNER.DeviceInput(parts[0].__dlpack__()), parts[1], RUNNER.DeviceInput(parts[2].__dlpack__())]
    bucket._gather_on_device("x", feeds, bucket.host["x"])
    np.testing.assert_array_equal(bound[:6], np.concatenate(parts))
    assert (bound[6:] == -1).all()  # the padding rows are left alone


def test_a_device_tensor_of_another_dtype_is_refused_not_reinterpreted(monkeypatch: pytest.MonkeyPatch) -> None:
    """int32 rows have float32's byte size: copying them as they are would feed the model garbage."""
    monkeypatch.setattr(RUNNER.DeviceInput, "devices", (DL_CPU,))
    copies = _memmove_cuda(monkeypatch)
    bucket, bound = _bucket(4, (3,))
    ints = np.arange(6, dtype=np.int32).reshape(2, 3)
    with pytest.raises(ValueError, match=r"^input x: a device tensor of int32 where the model takes float32$"):
        bucket._gather_on_device("x", [RUNNER.DeviceInput(ints.__dlpack__())], bucket.host["x"])
    assert copies == [] and (bound == -1).all()


def test_a_contiguous_tensor_with_a_size_one_dim_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """DLPack strides of a size-1 dim say nothing about the layout (the python backend's own check skips
    them); a dim of size > 1 with the wrong stride is still refused."""
    monkeypatch.setattr(RUNNER.DeviceInput, "devices", (DL_CPU,))
    data = np.arange(8, dtype=np.float32)
    shape, strides = (ctypes.c_int64 * 3)(1, 2, 4), (ctypes.c_int64 * 3)(99, 4, 1)  # numpy exports no such strides
    tensor = RUNNER._DLTensor(data=data.ctypes.data, ndim=3, shape=shape, strides=strides, byte_offset=4)
    tensor.device.device_type, tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes = DL_CPU, 2, 32, 1
    new_capsule = ctypes.pythonapi.PyCapsule_New
    new_capsule.restype, new_capsule.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    view = RUNNER.DeviceInput(new_capsule(ctypes.addressof(tensor), b"dltensor", None))
    assert view.shape == (1, 2, 4) and view.ptr == data.ctypes.data + 4 and view.nbytes == 32
    assert view.dtype == np.float32 and len(view) == 1
    with pytest.raises(ValueError, match="non-contiguous"):
        RUNNER.DeviceInput(np.zeros((3, 4), dtype=np.float32)[:, ::2].__dlpack__())


def _capsule(data: NDArray[Any], shape: tuple[int, ...], *, device_id: int = 0) -> Any:
    """A DLPack capsule of `data` (row-major, NULL strides) that says it lives on device `device_id`."""
    dims = (ctypes.c_int64 * len(shape))(*shape)
    tensor = RUNNER._DLTensor(data=data.ctypes.data, ndim=len(shape), shape=dims)
    tensor.device.device_type, tensor.device.device_id = DL_CPU, device_id
    tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes = 2, 32, 1
    new_capsule = ctypes.pythonapi.PyCapsule_New
    new_capsule.restype, new_capsule.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    capsule = new_capsule(ctypes.addressof(tensor), b"dltensor", None)
    return capsule, (tensor, dims)  # the struct and its shape must outlive the capsule's readers


def test_runtime_calls_run_on_the_tensors_own_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a host of several GPUs a stub serving GPU 3 must not open a context on GPU 0: the host copy of
    a device input selects the tensor's device, and page-locking selects the instance's, before any other
    runtime call."""
    monkeypatch.setattr(RUNNER.DeviceInput, "devices", (DL_CPU,))
    calls: list[tuple[Any, ...]] = []
    _memmove_cuda(monkeypatch, calls)
    data = np.arange(6, dtype=np.float32)
    capsule, _keep = _capsule(data, (2, 3), device_id=3)
    view = RUNNER.DeviceInput(capsule)
    assert view.device_id == 3
    np.testing.assert_array_equal(view.numpy(), data.reshape(2, 3))
    assert calls[0] == ("cudaSetDevice", 3) and ("cudaMemcpyAsync", 24) in calls
    calls.clear()
    staging = np.zeros((4, 8), dtype=np.float32)
    assert RUNNER._pin(staging, 2) is True
    assert calls == [("cudaSetDevice", 2), ("cudaHostRegister", staging.nbytes)]
