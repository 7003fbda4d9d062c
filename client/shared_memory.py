"""`--shared-memory system|cuda`: request tensors handed to a local Triton through shared memory.

perf_analyzer's options and layout: one region per input tensor of each payload, filled once and
reused by every request that sends the payload; with `--output-shared-memory-size` > 0, one region per
output of each model that every answer is written into (never read back: the load path does not decode
answers). A `--validate` payload gets its outputs in the answer, so they can be compared.

Regions are registered with the server by name and, on `close()` (also after errors, Ctrl-C and a dead
server), unregistered one by one (best effort: a dead server cannot answer) and unlinked locally.

System regions are Python's `multiprocessing.shared_memory` segments, which is what tritonclient's own
system shared-memory module uses from 2.55 on: the 2.50 module that pins perf_analyzer's binary here
finds its C helper through `pkg_resources`, which setuptools 81 removed. The standard library's resource
tracker also unlinks a segment its creator left behind when the process is killed outright (SIGKILL), so
no /dev/shm entry outlives perfclient. CUDA regions are device buffers allocated through cuda-python
(`client.cuda_memory`; tritonclient 2.50's CUDA module needs the `cuda.cudart` that cuda-python 13 dropped),
registered with their IPC handle; the server opens them once and reads each request's tensors in place.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from multiprocessing import shared_memory as mpshm
from typing import Any

import numpy as np
from numpy.typing import NDArray

from client import cuda_memory
from client.errors import PerfClientError
from client.wire import ShmLayout, ShmRef
from common.choices import Choice
from common.datatypes import numpy_dtype

log = logging.getLogger(__name__)

FLAG = "--shared-memory"
SIZE_FLAG = "--output-shared-memory-size"
# perf_analyzer's default for --output-shared-memory-size (bytes per output region).
DEFAULT_OUTPUT_SIZE = 102400
# Registration and unregistration calls: short, so cleanup after a server's death does not hang.
CONTROL_TIMEOUT_S = 5.0
# The prefix of every region name and /dev/shm key perfclient creates (tests look for leftovers by it).
PREFIX = "perfclient"
# How long close() waits for requests a run abandoned to stop writing into a region (Triton refuses to
# unregister a region in use).
IN_USE_WAIT_S = 5.0


class SharedMemoryKind(Choice):
    NONE = "none"
    SYSTEM = "system"
    CUDA = "cuda"


@dataclass(frozen=True)
class SharedMemory:
    """`--shared-memory KIND` and `--output-shared-memory-size BYTES` (0: outputs come in the answer)."""

    kind: SharedMemoryKind = SharedMemoryKind.NONE
    output_size: int = DEFAULT_OUTPUT_SIZE
    device_id: int = 0  # the GPU CUDA regions are allocated on
    # Sent with every region request: registering is a restricted API on an exposed server (client.admin_key).
    headers: tuple[tuple[str, str], ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", SharedMemoryKind.parse(self.kind, FLAG, error=PerfClientError))
        self.check()

    def check(self) -> None:
        if self.output_size < 0:
            raise PerfClientError(f"{SIZE_FLAG} {self.output_size}: expected a size in bytes >= 0")

    @property
    def enabled(self) -> bool:
        return self.kind is not SharedMemoryKind.NONE


@dataclass
class _Region:
    name: str  # registered under this name; the system segment's key is "/" + name
    byte_size: int
    release: Callable[[], None]  # unmap and unlink (system) or free (CUDA)
    buffer: cuda_memory.DeviceBuffer | None = None  # CUDA: the device buffer
    ipc_handle: bytes = b""  # CUDA: its IPC handle (base64), which registration sends
    segment: mpshm.SharedMemory | None = None  # system: the mapped segment
    registered: bool = False


def _output_bytes(datatype: str, shape: list[int], batch: int | None) -> int | None:
    """Bytes of one answer's output, when its shape is known (a leading -1 is the request's batch)."""
    try:
        itemsize = numpy_dtype(datatype).itemsize
    except KeyError:
        return None
    dims = list(shape)
    if dims and dims[0] == -1 and batch is not None:
        dims[0] = batch
    if any(d < 0 for d in dims) or datatype == "BYTES":
        return None
    return math.prod(dims) * itemsize


class SharedMemoryPool:
    """The regions of one connection: created as payloads are prepared, all released by `close()`.

    Control calls go through tritonclient's synchronous clients: they happen before the load starts and
    after it ends, never on the hot path.
    """

    def __init__(self, config: SharedMemory, *, protocol: str, url: str) -> None:
        self.config = config
        self.protocol = protocol
        self.url = url
        self._token = f"{PREFIX}_{os.getpid()}_{secrets.token_hex(4)}"
        self._regions: list[_Region] = []
        self._outputs: dict[str, dict[str, ShmRef]] = {}  # model -> output name -> its region
        self._cudart = cuda_memory.runtime(FLAG) if config.kind is SharedMemoryKind.CUDA else None
        self._client: Any
        if protocol == "grpc":
            import tritonclient.grpc as grpc_tc

            self._client = grpc_tc.InferenceServerClient(url=url)
        else:
            import tritonclient.http as http_tc

            self._client = http_tc.InferenceServerClient(url=url, connection_timeout=CONTROL_TIMEOUT_S,
                                                         network_timeout=CONTROL_TIMEOUT_S)
        self._closed = False
        atexit.register(self.close)  # a path that skips close() (a bug) still leaves no segment behind

    @property
    def region_names(self) -> list[str]:
        return [region.name for region in self._regions]

    def _timeout(self) -> dict[str, Any]:
        """The keyword arguments of every request: the timeout (gRPC; HTTP's is the client's) and the headers."""
        options: dict[str, Any] = {"client_timeout": CONTROL_TIMEOUT_S} if self.protocol == "grpc" else {}
        if self.config.headers:
            options["headers"] = dict(self.config.headers)
        return options

    def _new_region(self, byte_size: int, data: NDArray[Any] | None) -> _Region:
        if self._closed:
            raise RuntimeError("shared-memory pool used after close()")
        name = f"{self._token}_{len(self._regions)}"
        size = max(byte_size, 1)  # a zero-byte tensor still needs a mappable region
        try:
            if self._cudart is None:
                region = self._system_region(name, size, data)
            else:
                region = self._cuda_region(name, size, data)
        except PerfClientError:
            raise
        except Exception as exc:
            raise PerfClientError(f"{FLAG} {self.config.kind}: cannot create a {size}-byte region "
                                  f"({type(exc).__name__}: {exc})") from exc
        self._regions.append(region)
        self._register(region)
        return region

    def _system_region(self, name: str, size: int, data: NDArray[Any] | None) -> _Region:
        segment = mpshm.SharedMemory(name=name, create=True, size=size)
        if data is not None:
            raw = np.ascontiguousarray(data).tobytes()
            view = segment.buf
            assert view is not None  # None only after close()
            view[: len(raw)] = raw
            del view  # an exported view would make close() fail

        def release() -> None:
            segment.close()
            segment.unlink()

        return _Region(name, size, release, segment=segment)

    def _cuda_region(self, name: str, size: int, data: NDArray[Any] | None) -> _Region:
        assert self._cudart is not None
        buffer = cuda_memory.DeviceBuffer(self._cudart, size, self.config.device_id)
        try:
            if data is not None:
                buffer.write(np.ascontiguousarray(data).tobytes())
            # Made here, not in _register: a CUDA call of ours that fails is not the server refusing.
            handle = buffer.raw_handle_b64()
        except BaseException:
            buffer.free()
            raise
        return _Region(name, size, buffer.free, buffer=buffer, ipc_handle=handle)

    def _register(self, region: _Region) -> None:
        try:
            if region.buffer is None:
                self._client.register_system_shared_memory(region.name, f"/{region.name}", region.byte_size,
                                                           **self._timeout())
            else:
                self._client.register_cuda_shared_memory(region.name, region.ipc_handle, self.config.device_id,
                                                         region.byte_size, **self._timeout())
        except Exception as exc:
            raise PerfClientError(f"{FLAG} {self.config.kind}: the server at {self.url} refused to register "
                                  f"region {region.name} ({_first_line(exc)})") from exc
        region.registered = True
        log.debug("registered %s shared-memory region %s (%d bytes)", self.config.kind, region.name,
                  region.byte_size)

    def layout(self, model: str, arrays: Mapping[str, NDArray[Any]], *, outputs: bool) -> ShmLayout:
        """Regions holding `arrays` (one per input), and with `outputs`, the model's output regions."""
        inputs = {}
        for name, array in arrays.items():
            region = self._new_region(array.nbytes, array)
            inputs[name] = ShmRef(region.name, array.nbytes)
        out: Mapping[str, ShmRef] = {}
        if outputs and self.config.output_size > 0:
            batch = next((int(a.shape[0]) for a in arrays.values() if a.ndim), None)
            out = self._output_regions(model, batch)
        return ShmLayout(inputs, out)

    def _output_regions(self, model: str, batch: int | None) -> dict[str, ShmRef]:
        known = self._outputs.get(model)
        if known is not None:
            return known
        try:
            meta = self._client.get_model_metadata(model, **({"as_json": True, **self._timeout()}
                                                             if self.protocol == "grpc" else {}))
        except Exception as exc:
            raise PerfClientError(f"-m {model}: no metadata for its output regions ({_first_line(exc)})") from exc
        refs = {}
        for output in meta.get("outputs", []):
            name, datatype = output["name"], output["datatype"]
            need = _output_bytes(datatype, [int(d) for d in output.get("shape", [])], batch)
            if need is not None and need > self.config.output_size:
                raise PerfClientError(f"{SIZE_FLAG} {self.config.output_size}: output {name!r} of {model} needs "
                                      f"{need} bytes per answer; give at least that")
            region = self._new_region(self.config.output_size, None)
            refs[name] = ShmRef(region.name, self.config.output_size)
        self._outputs[model] = refs
        return refs

    def contents(self, ref: ShmRef) -> bytes:
        """The bytes `ref` points at in a region (what the server wrote into an output region)."""
        for region in self._regions:
            if region.name != ref.region:
                continue
            if region.buffer is not None:
                return region.buffer.read(ref.byte_size, ref.offset)
            if region.segment is not None and region.segment.buf is not None:
                return bytes(region.segment.buf[ref.offset : ref.offset + ref.byte_size])
        raise KeyError(f"no open region {ref.region!r}")

    def close(self) -> None:
        """Unregister every region from the server (best effort) and release it here; idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        pending = [region for region in self._regions if region.registered]
        deadline = time.monotonic() + IN_USE_WAIT_S
        while pending:
            busy = []
            for index, region in enumerate(pending):
                try:
                    self._unregister(region)
                except Exception as exc:  # noqa: BLE001 - a dead server cannot answer; the local part still goes
                    # Requests the run abandoned may still be answering into a region: Triton refuses until then.
                    if "in use" in str(exc) and time.monotonic() < deadline:
                        busy.append(region)
                        continue
                    # Any other failure: the server is gone or hung; asking about every other region would
                    # only add a timeout each.
                    log.debug("unregistering %s: %s; skipping %d more", region.name, _first_line(exc),
                              len(pending) - index - 1)
                    busy = []
                    break
            pending = busy
            if pending:
                time.sleep(0.05)
        for region in self._regions:
            try:
                region.release()
            except Exception as exc:  # noqa: BLE001 - release the rest whatever one of them raised
                log.warning("%s: cannot release region %s: %s", FLAG, region.name, _first_line(exc))
        log.debug("released %d shared-memory regions", len(self._regions))
        self._regions.clear()
        try:
            self._client.close()
        except Exception as exc:  # noqa: BLE001 - closing a client of a dead server
            log.debug("closing the shared-memory control client: %s", _first_line(exc))

    def _unregister(self, region: _Region) -> None:
        if region.buffer is None:
            self._client.unregister_system_shared_memory(region.name, **self._timeout())
        else:
            self._client.unregister_cuda_shared_memory(region.name, **self._timeout())


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0][:200] if lines else type(exc).__name__

