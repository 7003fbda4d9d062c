"""Device memory for `--shared-memory cuda`, through cuda-python's runtime bindings.

tritonclient 2.50's CUDA shared-memory module imports `cuda.cudart`, which cuda-python 13 (the
version that matches the CUDA 13 drivers of the GPU hosts) no longer has. What a region needs is
small: allocate, copy in, copy out, an IPC handle for the server, free. `cuda.bindings.runtime`
(cuda-python >= 12.6) and the older `cuda.cudart` expose the same calls.
"""

from __future__ import annotations

import base64
import ctypes
from typing import Any

from client.errors import PerfClientError

IPC_HANDLE_BYTES = 64  # CUDA_IPC_HANDLE_SIZE


def runtime(flag: str) -> Any:
    """cuda-python's runtime module, or one line naming `flag` and what is missing."""
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        try:
            from cuda import cudart  # cuda-python 12 before 12.6
        except ImportError as exc:
            raise PerfClientError(f"{flag} cuda: needs cuda-python and an NVIDIA GPU (pip install '.[gpu]'); "
                                  f"{exc}") from exc
    return cudart


class CudaError(RuntimeError):
    """A CUDA runtime call failed; the message names the call and CUDA's reason."""


def _check(cudart: Any, call: str, result: Any) -> Any:
    """cuda-python returns (error, value...) tuples: the value, or CudaError naming the call."""
    err = result[0] if isinstance(result, tuple) else result
    if int(err) != 0:
        _, text = cudart.cudaGetErrorString(err)
        reason = text.decode() if isinstance(text, bytes) else str(text)
        raise CudaError(f"{call}: {reason}")
    if isinstance(result, tuple) and len(result) > 1:
        return result[1] if len(result) == 2 else result[1:]
    return None


class DeviceBuffer:
    """`byte_size` bytes on GPU `device_id`, exportable to another process by IPC handle."""

    def __init__(self, cudart: Any, byte_size: int, device_id: int) -> None:
        self._rt = cudart
        self.byte_size = byte_size
        self.device_id = device_id
        _check(cudart, f"cudaSetDevice({device_id})", cudart.cudaSetDevice(device_id))
        self.ptr = int(_check(cudart, f"cudaMalloc({byte_size})", cudart.cudaMalloc(byte_size)))

    def write(self, data: bytes | bytearray | memoryview, offset: int = 0) -> None:
        view = memoryview(data).cast("B")
        if offset < 0 or offset + view.nbytes > self.byte_size:
            raise ValueError(f"{view.nbytes} bytes at offset {offset} do not fit a {self.byte_size}-byte buffer")
        if not view.nbytes:
            return
        host = (ctypes.c_char * view.nbytes).from_buffer_copy(view)
        _check(self._rt, "cudaMemcpy(host to device)", self._rt.cudaMemcpy(
            self.ptr + offset, ctypes.addressof(host), view.nbytes, self._rt.cudaMemcpyKind.cudaMemcpyHostToDevice))

    def read(self, byte_size: int, offset: int = 0) -> bytes:
        if offset < 0 or offset + byte_size > self.byte_size:
            raise ValueError(f"{byte_size} bytes at offset {offset} are outside a {self.byte_size}-byte buffer")
        host = (ctypes.c_char * byte_size)()
        if byte_size:
            _check(self._rt, "cudaMemcpy(device to host)", self._rt.cudaMemcpy(
                ctypes.addressof(host), self.ptr + offset, byte_size, self._rt.cudaMemcpyKind.cudaMemcpyDeviceToHost))
        return bytes(host)

    def ipc_handle(self) -> bytes:
        """The 64-byte cudaIpcMemHandle_t another process opens this buffer with."""
        handle = _check(self._rt, "cudaIpcGetMemHandle", self._rt.cudaIpcGetMemHandle(self.ptr))
        return ctypes.string_at(handle.getPtr(), IPC_HANDLE_BYTES)

    def raw_handle_b64(self) -> bytes:
        """The IPC handle as tritonclient's register_cuda_shared_memory takes it (base64)."""
        return base64.b64encode(self.ipc_handle())

    def free(self) -> None:
        if self.ptr:
            ptr, self.ptr = self.ptr, 0
            _check(self._rt, "cudaFree", self._rt.cudaFree(ptr))
