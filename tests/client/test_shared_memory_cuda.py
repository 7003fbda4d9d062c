"""`--shared-memory cuda` on a host without a GPU: cuda-python's runtime is replaced by a stand-in that
allocates host blocks (so the bytes can be read back) and records what is still allocated. What is
checked is the pool's own bookkeeping: every device buffer is freed on every failure path (a copy that
fails, Ctrl-C during a copy, a dead server, a server that refuses the region) and each failure is one
line naming what failed. A real GPU run of the same path is bench/gpu/validate_gpu.py."""

from __future__ import annotations

import ctypes
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from client.errors import PerfClientError
from client.shared_memory import SharedMemory, SharedMemoryKind, SharedMemoryPool
from client.wire import ShmRef
from tests.helpers.scripts import install_cuda_runtime
from tests.helpers.servers import Endpoints


class _IpcHandle:
    def __init__(self, raw: bytes) -> None:
        self._raw = ctypes.create_string_buffer(raw, 64)

    def getPtr(self) -> int:
        return ctypes.addressof(self._raw)


class FakeCudart(types.ModuleType):
    """cuda.bindings.runtime as client.cuda_memory calls it: (error, value) tuples, errors as ints."""

    def __init__(self) -> None:
        super().__init__("cuda.bindings.runtime")
        self.blocks: dict[int, Any] = {}  # address -> the host block standing in for device memory
        self.fail: dict[str, Any] = {}  # call name -> an error code to return, or an exception to raise
        self.cudaMemcpyKind = types.SimpleNamespace(cudaMemcpyHostToDevice=1, cudaMemcpyDeviceToHost=2)

    def _failure(self, call: str) -> int:
        outcome = self.fail.get(call, 0)
        if isinstance(outcome, BaseException):
            raise outcome
        return int(outcome)

    def cudaSetDevice(self, device: int) -> tuple[int]:
        return (self._failure("cudaSetDevice"),)

    def cudaMalloc(self, size: int) -> tuple[int, int | None]:
        err = self._failure("cudaMalloc")
        if err:
            return err, None
        block = (ctypes.c_char * size)()
        self.blocks[ctypes.addressof(block)] = block
        return 0, ctypes.addressof(block)

    def cudaMemcpy(self, dst: int, src: int, size: int, kind: int) -> tuple[int]:
        err = self._failure("cudaMemcpy")
        if not err:
            ctypes.memmove(dst, src, size)
        return (err,)

    def cudaIpcGetMemHandle(self, ptr: int) -> tuple[int, _IpcHandle | None]:
        err = self._failure("cudaIpcGetMemHandle")
        return (err, None) if err else (0, _IpcHandle(ptr.to_bytes(8, "little") * 8))

    def cudaFree(self, ptr: int) -> tuple[int]:
        self.blocks.pop(ptr)
        return (0,)

    def cudaGetErrorString(self, err: int) -> tuple[int, bytes]:
        return 0, f"fake reason {int(err)}".encode()


@pytest.fixture
def cudart(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCudart]:
    runtime = FakeCudart()
    install_cuda_runtime(monkeypatch, runtime)
    yield runtime
    assert runtime.blocks == {}, "a device buffer outlived the test"


X = np.arange(2 * 4 * 32, dtype=np.float32).reshape(2, 4, 32)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_dead_server_is_one_line_and_every_buffer_is_freed(cudart: FakeCudart, dead_url: str,
                                                             protocol: str) -> None:
    pool = SharedMemoryPool(SharedMemory(SharedMemoryKind.CUDA, 0), protocol=protocol, url=dead_url)
    try:
        with pytest.raises(PerfClientError) as info:
            pool.layout("mlp_fp32", {"x": X}, outputs=False)
        message = str(info.value)
        assert "\n" not in message and message.startswith(f"--shared-memory cuda: the server at {dead_url} refused")
        (name,) = pool.region_names
        assert pool.contents(ShmRef(name, X.nbytes)) == X.tobytes()  # what was copied in is the tensor
        assert len(cudart.blocks) == 1
    finally:
        pool.close()
    assert cudart.blocks == {}


@pytest.fixture
def pool(cudart: FakeCudart, dead_url: str) -> Iterator[SharedMemoryPool]:
    """A CUDA region pool for a server that is not there, closed at the end (before `cudart` checks)."""
    pool = SharedMemoryPool(SharedMemory(SharedMemoryKind.CUDA, 0), protocol="grpc", url=dead_url)
    try:
        yield pool
    finally:
        pool.close()


def test_a_failed_copy_frees_its_buffer_at_once(cudart: FakeCudart, pool: SharedMemoryPool) -> None:
    cudart.fail["cudaMemcpy"] = 1
    with pytest.raises(PerfClientError, match=r"^--shared-memory cuda: cannot create a 1024-byte region "
                                              r"\(CudaError: cudaMemcpy\(host to device\): fake reason 1\)$"):
        pool.layout("mlp_fp32", {"x": X}, outputs=False)
    assert cudart.blocks == {} and pool.region_names == []


def test_ctrl_c_during_a_copy_frees_its_buffer(cudart: FakeCudart, pool: SharedMemoryPool) -> None:
    cudart.fail["cudaMemcpy"] = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt):
        pool.layout("mlp_fp32", {"x": X}, outputs=False)
    assert cudart.blocks == {}


def test_a_device_that_cannot_be_used_is_one_line(cudart: FakeCudart, pool: SharedMemoryPool) -> None:
    cudart.fail["cudaSetDevice"] = 101
    with pytest.raises(PerfClientError, match=r"cannot create a 1024-byte region \(CudaError: "
                                              r"cudaSetDevice\(0\): fake reason 101\)$"):
        pool.layout("mlp_fp32", {"x": X}, outputs=False)


def test_an_ipc_handle_that_cannot_be_had_is_not_blamed_on_the_server(cudart: FakeCudart,
                                                                     pool: SharedMemoryPool) -> None:
    """The handle is ours to make: its failure names the CUDA call, not a server refusal."""
    cudart.fail["cudaIpcGetMemHandle"] = 201
    with pytest.raises(PerfClientError) as info:
        pool.layout("mlp_fp32", {"x": X}, outputs=False)
    message = str(info.value)
    assert "cudaIpcGetMemHandle: fake reason 201" in message and "refused" not in message, message


def test_a_server_that_refuses_the_region_leaves_nothing_registered_or_allocated(
        cudart: FakeCudart, endpoints: Endpoints) -> None:
    """The shared CPU-only server cannot open the (stand-in) IPC handle: one line; nothing stays behind."""
    import tritonclient.grpc as grpc_tc

    pool = SharedMemoryPool(SharedMemory(SharedMemoryKind.CUDA, 4096), protocol="grpc", url=endpoints.grpc)
    try:
        with pytest.raises(PerfClientError) as info:
            pool.layout("mlp_fp32", {"x": X}, outputs=True)
        message = str(info.value)
        assert "\n" not in message and "refused to register region" in message, message
    finally:
        pool.close()
    assert cudart.blocks == {}
    client = grpc_tc.InferenceServerClient(url=endpoints.grpc)
    try:
        status = client.get_cuda_shared_memory_status(as_json=True)
    finally:
        client.close()
    assert not status.get("regions"), status
